"""Marks for tests that read the real data in `../shared/data` (TRAINWISE_DATA_DIR): on a clone
without it they skip with a reason instead of failing on a missing file."""

import pytest

from cloud.traces import default_spot_dir

needs_spot_data = pytest.mark.skipif(
    not default_spot_dir().is_dir(),
    reason=f"shared spot data not at {default_spot_dir()} (set TRAINWISE_DATA_DIR)")
