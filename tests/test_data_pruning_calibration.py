"""The simulator's pruning calibration loader: measured fraction, missing file, bad files."""

from __future__ import annotations

import json

import pytest

from training.pruning_calibration import CALIBRATION_FORMAT, work_fraction


def write(path, datasets, fmt=CALIBRATION_FORMAT):
    path.write_text(json.dumps({"format": fmt, "datasets": datasets}))
    return path


def test_the_measured_fraction_is_returned(tmp_path):
    path = write(tmp_path / "c.json", {"mnist": {"work_fraction": 0.72, "source_runs": ["a"]}})
    assert work_fraction("mnist", path) == 0.72


def test_a_missing_file_means_no_saving_with_a_note(tmp_path):
    with pytest.warns(UserWarning, match="assuming pruning saves no work.*benchmarks.data"):
        assert work_fraction("mnist", tmp_path / "missing.json") == 1.0


@pytest.mark.parametrize(
    "datasets, fmt, message",
    [({"mnist": {"work_fraction": 0.7}}, CALIBRATION_FORMAT, "no dataset 'cifar'.*mnist"),
     ({"cifar": {"work_fraction": -0.1}}, CALIBRATION_FORMAT, "expected a number"),
     ({"cifar": {"work_fraction": None}}, CALIBRATION_FORMAT, "expected a number"),
     ({"cifar": {"work_fraction": 0.7}}, "other/1", "is not"),
     ],
)
def test_bad_calibrations_are_refused(tmp_path, datasets, fmt, message):
    with pytest.raises(ValueError, match=message):
        work_fraction("cifar", write(tmp_path / "c.json", datasets, fmt))
