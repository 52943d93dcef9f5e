import json

import pytest

from benchmarks import controller_overhead
from benchmarks.results_io import machine


def test_benchmark_writes_json_and_markdown(tmp_path):
    status = controller_overhead.main(["--calls", "200", "--step-time-ms", "100",
                                       "--out-dir", str(tmp_path)])
    assert status == 0
    result = json.loads((tmp_path / "controller_overhead.json").read_text())
    meta = result["meta"]
    assert meta["machine"] == machine() and "--calls 200" in meta["command"]
    assert [row["ranks"] for row in result["rows"]] == [1, 8]
    for row in result["rows"]:
        for path in ("policy_act", "controller_act", "controller_on_step"):
            p = row[path]
            assert 0 < p["p50_us"] <= p["p99_us"] <= p["max_us"]
        assert 0 < row["share_of_step_time"] < 1
    markdown = (tmp_path / "controller_overhead.md").read_text()
    assert "| 8 | HeuristicFastPolicy.act | 200 |" in markdown
    assert not list(tmp_path.glob(".*"))  # no temp file left behind


def test_benchmark_refuses_too_few_calls(tmp_path):
    with pytest.raises(SystemExit):
        controller_overhead.main(["--calls", "10", "--out-dir", str(tmp_path)])
