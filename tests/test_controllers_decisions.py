import json

import pytest

from controllers.decisions import Decision, DecisionLog, format_timeline


def decision(time_s: float, layer: str = "fast", reason: str = "why") -> Decision:
    return Decision(time_s=time_s, step=int(time_s * 10), layer=layer, policy="heuristic_fast",
                    action={"micro_batch_size": 32, "rank_work_shares": [0.5, 0.5]},
                    reason=reason, numbers={"b_noise_ema": 123.456789})


def test_round_trip_through_json():
    d = decision(1.5)
    assert Decision.from_dict(json.loads(json.dumps(d.to_dict()))) == d


def test_from_dict_names_missing_keys_and_bad_layer():
    with pytest.raises(ValueError, match="reason"):
        Decision.from_dict({"time_s": 0, "step": 0, "layer": "fast", "policy": "p", "action": {}})
    record = decision(0).to_dict() | {"layer": "medium"}
    with pytest.raises(ValueError, match="medium"):
        Decision.from_dict(record)


def test_log_keeps_decisions_and_calls_the_sink():
    seen = []
    log = DecisionLog(sink=seen.append, max_kept=2)
    for t in (1.0, 2.0, 3.0):
        log.record(decision(t, layer="slow" if t == 2.0 else "fast"))
    assert [d.time_s for d in seen] == [1.0, 2.0, 3.0]
    assert [d.time_s for d in log.decisions] == [2.0, 3.0]  # only the last max_kept
    assert log.recorded_total == 3
    assert [d.time_s for d in log.of_layer("slow")] == [2.0]
    as_dict = log.to_dict()
    assert as_dict["recorded_total"] == 3 and len(as_dict["decisions"]) == 2


def test_sink_errors_propagate():
    def broken(_: Decision) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        DecisionLog(sink=broken).record(decision(0.0))


def test_timeline_is_in_time_order_with_reason_action_and_numbers():
    text = format_timeline([decision(5.0, reason="second"),
                            decision(1.0, "slow", "first").to_dict()])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["time_s", "step", "layer"]
    assert text.index("first") < text.index("second")
    assert "slow  heuristic_fast: first" in text
    assert "rank_work_shares=[0.5,0.5]" in text
    assert "b_noise_ema=123.5" in text


def test_empty_timeline_says_so():
    assert format_timeline([]) == "no decisions recorded"
