"""The slow-policy sensor proposes; the live run changes only after the curriculum gate passed,
under a recorded automatic-approval rule a person can switch off. Finished runs are left alone."""

import json

import dagster as dg
import pytest

from pipelines.definitions import defs
from sensors.slow_policy import slow_policy_sensor
from telemetry import events
from telemetry.writer import SegmentWriter
from training import curriculum as curriculum_lib
from training.dynamic_pruning import read_pruning_control
from trainwise import settings, slow_tick


def _evaluate(instance, cursor=None):
    context = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)
    return slow_policy_sensor.evaluate_tick(context)


def _curriculum_requests(result) -> list:
    return [r for r in result.run_requests if r.job_name == "curriculum_refresh"]


def _apply_decisions(instance, result) -> list:
    """Runs the `apply_run_decision` runs the sensor asked for, as the daemon would."""
    runs = []
    for request in result.run_requests:
        if request.job_name == "apply_run_decision":
            done = defs.resolve_job_def("apply_run_decision").execute_in_process(
                instance=instance, run_config=request.run_config, tags=request.tags)
            assert done.success
            runs.append(done)
    return runs


def _live_run(run_id: str, steps: int, losses: list[float],
              data_selection: str = "static") -> None:
    """A run still training: request file and telemetry, no run_end yet."""
    run_dir = settings.home_dir() / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "request.json").write_text(json.dumps({
        "partition": "pystdlib", "max_steps": 1000, "data_selection": data_selection}))
    with SegmentWriter(run_dir / "telemetry", run_id) as writer:
        for step in range(1, steps + 1):
            writer.write(events.StepEvent(
                run_id=run_id, step=step, train_loss=3.0, learning_rate=1e-3, grad_norm=1.0,
                grad_noise_scale=float("nan"), micro_batch_size=32, grad_accum_steps=1,
                step_time_ms=100.0, samples_seen=32 * step, tokens_seen=2048 * step,
                elapsed_s=0.1 * step, cost_usd=0.0001 * step))
        for i, loss in enumerate(losses):
            writer.write(events.EvalEvent(run_id=run_id, step=(i + 1) * 50, eval_loss=loss,
                                          eval_accuracy=None, eval_examples=256, eval_ms=5.0))


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def test_sensor_requests_new_curriculum_for_live_run_once(instance):
    job = defs.resolve_job_def("demo")
    assert job.execute_in_process(
        partition_key="pystdlib", instance=instance,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": 0.0}},
                            "checkpoint": {"config": {"max_steps": 4}}}}).success
    # The finished demo run is not steered.
    result = _evaluate(instance)
    assert not result.run_requests and "nothing to steer" in result.skip_message

    _live_run("live-run-1", steps=200, losses=[3.0, 2.6, 2.3, 2.1], data_selection="dynamic")
    result = _evaluate(instance)
    [request] = _curriculum_requests(result)
    rate = request.run_config["ops"]["curriculum"]["config"]["pruning_rate"]
    assert request.partition_key == "pystdlib" and rate >= 0.05
    assert request.tags["trainwise/steered_run"] == "live-run-1"
    assert "pruning" in request.tags["trainwise/reason"]
    # A proposal only: nothing reaches the live run before the gate.
    control_file = settings.home_dir() / "runs" / "live-run-1" / "control.json"
    assert not control_file.exists()

    # Same tick again with the cursor: no duplicate request.
    again = _evaluate(instance, cursor=result.cursor)
    assert not again.run_requests

    # Running what the sensor asked for: the gate passes, the curriculum at that rate is
    # published, and only then does the live run get the rate (auto-approval rule, recorded).
    refresh = defs.resolve_job_def("curriculum_refresh").execute_in_process(
        partition_key="pystdlib", instance=instance, run_config=request.run_config)
    assert refresh.success
    folder = settings.home_dir() / "curricula" / "pystdlib"
    built = curriculum_lib.load_curriculum(folder)
    assert built.pruning_rate == pytest.approx(rate)
    control = read_pruning_control(control_file)
    assert control.pruning_rate == pytest.approx(rate) and built.version in control.reason
    live = curriculum_lib.read_history(folder)[-1]
    assert live["event"] == "live_change" and live["status"] == "applied"
    assert live["rule"]["set_by"] == "default" and "auto-approval" in live["approved_by"]


def _sensor_refresh(instance, run_id):
    _live_run(run_id, steps=200, losses=[3.0, 2.6, 2.3, 2.1], data_selection="dynamic")
    [request] = _curriculum_requests(_evaluate(instance))
    return defs.resolve_job_def("curriculum_refresh").execute_in_process(
        partition_key="pystdlib", instance=instance, run_config=request.run_config,
        raise_on_error=False)


def test_live_change_waits_when_the_gate_fails(instance, monkeypatch):
    assert defs.resolve_job_def("demo").execute_in_process(
        partition_key="pystdlib", instance=instance,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": 0.0}},
                            "checkpoint": {"config": {"max_steps": 2}}}}).success
    real = curriculum_lib.coverage_report
    monkeypatch.setattr(curriculum_lib, "coverage_report", lambda examples, built: {
        **real(examples, built), "passed": False, "failures": ["injected"], "reason": "injected"})
    refresh = _sensor_refresh(instance, "live-run-3")
    assert not refresh.success
    assert not (settings.home_dir() / "runs" / "live-run-3" / "control.json").exists()


def test_live_change_is_pending_when_a_person_turns_auto_approval_off(instance):
    assert defs.resolve_job_def("demo").execute_in_process(
        partition_key="pystdlib", instance=instance,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": 0.0}},
                            "checkpoint": {"config": {"max_steps": 2}}}}).success
    switch = defs.resolve_job_def("live_change_rule").execute_in_process(
        instance=instance, run_config={"ops": {"set_live_change_rule": {"config": {
            "auto_approve": False, "set_by": "alice", "why": "audit week"}}}})
    assert switch.success
    assert slow_tick.live_change_rule(settings.home_dir())["set_by"] == "alice"
    refresh = _sensor_refresh(instance, "live-run-4")
    assert refresh.success  # the curriculum passed its gate and is published ...
    run_dir = settings.home_dir() / "runs" / "live-run-4"
    assert not (run_dir / "control.json").exists()  # ... but the live change waits
    pending = json.loads((run_dir / "control.pending.json").read_text())
    assert pending["status"] == "pending: automatic approval is off"
    assert pending["rule"]["why"] == "audit week"


def test_sensor_holds_rate_when_eval_loss_regresses(instance):
    job = defs.resolve_job_def("demo")
    assert job.execute_in_process(
        partition_key="pystdlib", instance=instance,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": 0.0}},
                            "checkpoint": {"config": {"max_steps": 4}}}}).success
    _live_run("live-run-2", steps=200, losses=[2.0, 2.5])  # +25%: the quality guard
    result = _evaluate(instance)
    assert not _curriculum_requests(result)
    # The hold is a decision about how the run trains (its interval), applied by a recorded run
    # whose reason says why the rate is held.
    [decision] = result.run_requests
    assert decision.job_name == "apply_run_decision"
    assert "regressed" in decision.tags["trainwise/reason"]
    assert not (settings.home_dir() / "runs" / "live-run-2" / "control.json").exists()


def _gang_record(run_id: str, market: str, reclaims: int) -> None:
    """What the run's provider session records (trainwise.gang): the nodes it holds."""
    run_dir = settings.home_dir() / "runs" / run_id
    (run_dir / "gang.json").write_text(json.dumps({
        "provider": "emulated", "market": market, "zone": "us-east-1a", "nodes": 1,
        "reclaims": reclaims, "allocation": {"market": market, "zone": "us-east-1a",
                                             "nodes": 1, "reason": "test", "source": "request"}}))


def test_sensor_hands_checkpoint_interval_risk_and_allocation_to_the_live_run(instance):
    from controllers.allocation_types import AllocationAction
    from controllers.slow_heuristic import HeuristicSlowPolicy
    from training.live_control import read_live_control
    from trainwise import gang

    assert defs.resolve_job_def("demo").execute_in_process(
        partition_key="pystdlib", instance=instance,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": 0.0}},
                            "checkpoint": {"config": {"max_steps": 2}}}}).success
    # A spot run that was reclaimed twice: its hazard sets the risk and the interval.
    _live_run("live-spot", steps=200, losses=[3.0, 2.6])
    _gang_record("live-spot", "spot", reclaims=2)
    result = _evaluate(instance)
    run_dir = settings.home_dir() / "runs" / "live-spot"
    # The sensor itself writes nothing to the live run: a recorded run applies its decision.
    assert not (run_dir / "live_control.json").exists()
    [applied] = _apply_decisions(instance, result)
    [record] = [json.loads(line) for line in
                (run_dir / "slow_decisions.jsonl").read_text().splitlines()]
    assert record["applied_by"] == f"dagster run {applied.run_id}"
    assert instance.get_run_by_id(applied.run_id).tags["trainwise/steered_run"] == "live-spot"
    # The same decision on the next tick (cursor kept) is not asked for again.
    assert not [r for r in _evaluate(instance, cursor=result.cursor).run_requests
                if r.job_name == "apply_run_decision"]
    control = read_live_control(settings.home_dir() / "runs" / "live-spot" / "live_control.json")
    assert control.source == "slow_policy" and control.checkpoint_interval_s > 0
    assert 0.0 < control.preemption_risk < 1.0
    assert control.checkpoint_interval_s < 1e6, "a finite Young/Daly interval from the hazard"
    spot_risk = control.preemption_risk

    # The same run on demand: no reclaim risk handed to the trainer.
    _gang_record("live-spot", "on_demand", reclaims=0)
    slow_tick.apply_run_decisions(settings.home_dir(), slow_tick.decide(settings.home_dir(),
                                                                        "pystdlib"))
    control = read_live_control(settings.home_dir() / "runs" / "live-spot" / "live_control.json")
    assert control.preemption_risk == 0.0 < spot_risk

    # An allocation policy's move reaches the run's provider session as allocation.json.
    class MoveToSpot:
        name = "move_to_spot"

        def act(self, observation):
            return AllocationAction(zone="us-east-1c", spot_nodes=1, on_demand_nodes=0,
                                    reason="spot is back in us-east-1c")

    tick = slow_tick.decide(settings.home_dir(), "pystdlib",
                            HeuristicSlowPolicy(allocation_policy=MoveToSpot()))
    record = slow_tick.apply_run_decisions(settings.home_dir(), tick)
    assert record["allocation"] == {"market": "spot", "zone": "us-east-1c", "nodes": 1}
    wanted = gang.read_allocation(settings.home_dir() / "runs" / "live-spot")
    assert (wanted.market, wanted.zone, wanted.source) == ("spot", "us-east-1c", "slow_policy")
