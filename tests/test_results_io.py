"""Results files say which commit they measured and whether the tree had uncommitted changes."""

import json
import shutil
import subprocess

import pytest

from benchmarks import results_io

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_tree_dirty_follows_tracked_changes(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    assert results_io.git_tree_dirty(tmp_path) is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results_io.git_tree_dirty(tmp_path) is True


def test_a_changed_result_file_does_not_make_the_tree_dirty(tmp_path):
    """A suite writes its plot before its tables: its own output must not mark its run dirty."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "cost.md").write_text("old figures\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    (results / "cost.md").write_text("new figures\n")
    assert results_io.git_tree_dirty(tmp_path) is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results_io.git_tree_dirty(tmp_path) is True


def test_tree_dirty_is_unknown_outside_a_repository(tmp_path):
    assert results_io.git_tree_dirty(tmp_path) is None


def test_results_record_commit_and_dirty_flag(tmp_path):
    meta = {"command": "python -m x", "commit": "abc123", "tree_dirty": True,
            "date_utc": "2026-11-30T00:00:00+00:00"}
    json_path, md_path = results_io.write_results(tmp_path, "r", {"value": 1}, "# r", meta)
    assert json.loads(json_path.read_text())["meta"]["tree_dirty"] is True
    assert "at commit abc123 with uncommitted changes" in md_path.read_text()
    assert "tree_dirty" in results_io.provenance(["x"])
