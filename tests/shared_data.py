"""Marks for tests that read the real data in `../shared/data` (TRAINWISE_DATA_DIR): on a clone
without it they skip with a reason instead of failing on a missing file."""

import pytest

from cloud.traces import default_spot_dir

needs_spot_data = pytest.mark.skipif(
    not default_spot_dir().is_dir(),
    reason=f"shared spot data not at {default_spot_dir()} (set TRAINWISE_DATA_DIR)")


def _cant_be_late_ready() -> bool:
    from benchmarks.cant_be_late import scenario

    return ((scenario.peers_dir() / "policies-per-window.csv.gz").exists()
            and all((default_spot_dir() / f).is_dir() for f in scenario.COLLECTIONS.values()))


needs_cant_be_late_reference = pytest.mark.skipif(
    not _cant_be_late_ready(),
    reason="the Can't Be Late reference (../shared/data/peers/cant-be-late) or its traces are "
    "missing: this test needs ../shared/data (TRAINWISE_DATA_DIR)")
