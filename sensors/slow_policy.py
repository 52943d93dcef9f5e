"""The slow layer in Dagster: a sensor that re-decides each partition's pruning rate.

On its interval it reads the live telemetry of each partition's latest run, asks the slow
policy, and when the rate moved enough requests a re-materialization of that partition's
curriculum. Otherwise it says why it skipped. The cursor remembers the last decision per
partition so a decision is requested once.

The sensor is pure: it reads, and returns run requests or a skip reason. How the run trains
(`slow_tick.run_decision`: the checkpoint interval and the preemption risk for the trainer's
live-control file, a new allocation for the run's provider session) is applied by a recorded
run of the `apply_run_decision` job, so the UI shows who changed the running job, what, when.

What the run learns from is a proposal: the requested run builds a candidate
curriculum carrying the live change; only when its blocking check `curriculum_coverage` passes
is the candidate published and the new rate handed to the running job, under the recorded
automatic-approval rule (`trainwise.slow_tick.live_change_rule`, switched by the
`live_change_rule` job). A failed gate leaves the running job untouched.
"""

import hashlib
import json

import dagster as dg

from assets.partitions import DATA_PARTITIONS
from pipelines.jobs import curriculum_job, run_decision_job
from trainwise import settings, slow_tick

# A smaller change is not worth a new curriculum version (and a sampler epoch restart).
MIN_RATE_CHANGE = 0.05


@dg.sensor(jobs=[curriculum_job, run_decision_job],
           minimum_interval_seconds=settings.sensor_interval_s(),
           default_status=dg.DefaultSensorStatus.STOPPED)
def slow_policy_sensor(context: dg.SensorEvaluationContext):
    """Slow layer: re-decides the pruning rate from live telemetry; proposes a new curriculum
    (and the live change) that goes live only through the curriculum gate."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    state_dir = settings.home_dir()
    requests, skips = [], []
    for partition in DATA_PARTITIONS:
        tick = slow_tick.decide(state_dir, partition)
        if tick.action is None:
            skips.append(f"{partition}: {tick.skip_reason}")
            continue
        decision = slow_tick.run_decision(state_dir, tick)
        text = json.dumps(decision, sort_keys=True) if decision is not None else ""
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        decision_key = f"decision:{tick.run_id}"
        # One run per distinct decision: the same decision next tick is not asked for again.
        if decision is not None and cursor.get(decision_key) != digest:
            cursor[decision_key] = digest
            requests.append(dg.RunRequest(
                job_name=run_decision_job.name,
                run_key=f"{decision_key}:{digest}",
                run_config={"ops": {"hand_decision_to_run": {"config": {"decision_json": text}}}},
                tags={"trainwise/layer": "slow", "trainwise/steered_run": tick.run_id or "",
                      "trainwise/reason": decision["reason"][:250]}))
        rate = round(tick.action.pruning_rate, 2)
        current = tick.current_pruning_rate if tick.current_pruning_rate is not None else -1.0
        key = f"{partition}:{tick.run_id}:{rate:.2f}"
        if abs(rate - current) < MIN_RATE_CHANGE or cursor.get(partition) == key:
            skips.append(f"{partition}: rate {rate:.2f} ~ current {current:.2f} "
                         f"({tick.action.reason})")
            continue
        cursor[partition] = key
        reason = f"slow policy: {tick.action.reason}"[:250]
        requests.append(dg.RunRequest(
            job_name=curriculum_job.name,
            run_key=key,
            partition_key=partition,
            run_config={"ops": {"curriculum": {"config": {
                "pruning_rate": rate, "live_run_id": tick.run_id or "",
                "reason": reason, "requested_by": "slow_policy_sensor"}}}},
            tags={"trainwise/layer": "slow", "trainwise/reason": reason,
                  "trainwise/steered_run": tick.run_id or ""},
        ))
    context.update_cursor(json.dumps(cursor, sort_keys=True))
    if requests:
        return requests
    return dg.SkipReason("; ".join(skips) or "no partitions")
