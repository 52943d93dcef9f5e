# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""The train job runs through the compute provider (issue 10, items 1-3): the allocation is
launched at the provider and recorded on its node, a reclaim in the replayed trace is answered
(checkpoint, release, replacement, restore from the store, resume), the slow layer's new
allocation moves the live run, and bad provider input is a clear error or a recorded fallback,
never a success with a partial model.

`run_training` runs for real on the small pystdlib state of tests/test_run_path_faults.py, on an
`EmulatedProvider` whose one-zone market is a short array standing for a trace window (so the
reclaim comes at a known tick).
"""

from __future__ import annotations

import numpy as np
import pytest

from cloud import emulated as replay
from cloud.providers import (
    LaunchFailedError,
    ProviderUnreachableError,
    UnknownInstanceTypeError,
    UnknownZoneError,
)
from cloud.providers.emulated import EmulatedProvider
from controllers.fast_types import NoOpFastPolicy
from telemetry.reader import read_run_events
from tests.test_cloud_provider_aws import aws_env, moto_url  # noqa: F401 - fixtures
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    PARTITION,
    built_state,
    closed_port,
    request,
    run,
    state,
)
from trainwise import gang, runs


def market(zone: str, available: list[int]) -> replay.ReplayMarket:
    return replay.ReplayMarket(zone, "p3.2xlarge", 195, np.asarray(available, dtype=np.int64), 0,
                               f"test window for {zone}", 0.918, 3.06, "test")


def provider(*markets: replay.ReplayMarket, seconds_per_tick: float = 0.5) -> EmulatedProvider:
    clock = replay.ReplayClock(195.0, seconds_per_tick)
    return EmulatedProvider(list(markets), clock, replay.default_rules())


def launched(state, run_id="run-a") -> list[dict]:
    return gang.read_gang(state / "runs" / run_id)["launched"]


def test_spot_allocation_is_launched_in_its_zone_and_billed(state):
    cloud = provider(market("us-east-1a", [1] * 100_000), market("us-east-1c", [1] * 100_000))
    summary = run(state, request(market="spot", zone="us-east-1c"), provider=cloud)
    assert summary.status == "completed"
    [node] = launched(state)
    assert (node["market"], node["zone"], node["provider"]) == ("spot", "us-east-1c", "emulated")
    assert (summary.market, summary.zone, summary.nodes) == ("spot", "us-east-1c", 1)
    assert summary.spot_share == 1.0 and summary.cost_usd == pytest.approx(
        cloud.bill_usd()) and summary.cost_usd > 0
    assert not cloud.describe(cloud.nodes()[0]).state.alive, "released at the end"


def test_node_count_and_on_demand_are_what_the_provider_launched(state):
    cloud = provider(market("us-east-1a", [0] * 100_000))
    # Two nodes train as two torchrun ranks: at least one micro batch each.
    summary = run(state, request(nodes=2, grad_accum_steps=2), provider=cloud)
    nodes = launched(state)
    assert len(nodes) == 2 and {n["market"] for n in nodes} == {"on_demand"}
    assert summary.nodes == 2 and summary.spot_share == 0.0


def test_reclaim_is_answered_by_a_replacement_that_resumes_from_the_store(state):
    # Spot for three ticks, then none: the node is reclaimed at the run's first fast ticks; no
    # spot is left, so the replacement is on-demand (a recorded fallback) and training resumes.
    cloud = provider(market("us-east-1a", [1, 1, 1] + [0] * 100_000), seconds_per_tick=0.01)
    summary = run(state, request(market="spot", zone="us-east-1a", max_steps=8), provider=cloud)
    assert summary.status == "completed" and summary.steps == 8
    assert summary.reclaims == 1 and summary.replacements == 1
    nodes = launched(state)
    assert [(n["market"], n["zone"]) for n in nodes] == [("spot", "us-east-1a"),
                                                          ("on_demand", "us-east-1a")]
    record = gang.read_gang(state / "runs" / "run-a")
    assert record["fallbacks"] and "on-demand instead" in record["fallbacks"][0]
    events = [e["event"] for e in record["history"]]
    assert events == ["launch", "notice", "restore", "launch"], events
    restored_step = next(e["step"] for e in record["history"] if e["event"] == "restore")
    assert restored_step >= 1
    telemetry = read_run_events(state / "runs" / "run-a" / "telemetry" / "run-a", rank=0)
    starts = [e for e in telemetry if e["type"] == "run_start"]
    assert len(starts) == 2, "the replacement resumed the same training run"
    steps = sorted({e["step"] for e in telemetry if e["type"] == "step"})
    assert steps == list(range(1, 9))
    assert 0.0 < summary.spot_share < 1.0
    # The replacement's changeover is billed beyond the fixed on-demand schedule's work.
    assert summary.preemption_waste_node_s >= 360.0 - 1e-6
    assert summary.fixed_on_demand_usd > 0
    assert "1 reclaim(s), 1 replacement(s)" in summary.report(1.0, "dagster-run")


class MoveAt(NoOpFastPolicy):
    """At one step the slow layer writes a new allocation for the live run."""

    name = "move_at"

    def __init__(self, run_dir, step: int, allocation: gang.Allocation) -> None:
        self.run_dir, self.step, self.allocation = run_dir, step, allocation

    def act(self, observation):
        if observation.step == self.step:
            gang.write_allocation(self.run_dir, self.allocation)
        return super().act(observation)


@pytest.mark.parametrize("spot_in_target, landed", [(1, "spot"), (0, "on_demand")])
def test_slow_layers_new_allocation_moves_the_live_run(state, spot_in_target, landed):
    cloud = provider(market("us-east-1a", [1] * 100_000),
                     market("us-east-1c", [spot_in_target] * 100_000))
    target = gang.Allocation(market="spot", zone="us-east-1c", nodes=1, reason="cheaper zone",
                             source="slow_policy")
    summary = run(state, request(max_steps=8), provider=cloud,
                  fast_policy=MoveAt(state / "runs" / "run-a", 2, target))
    assert summary.status == "completed" and summary.steps == 8
    assert [(n["market"], n["zone"]) for n in launched(state)] == [
        ("on_demand", "us-east-1a"), (landed, "us-east-1c")]
    assert (summary.market, summary.zone) == (landed, "us-east-1c")
    # A refused spot move falls back once (recorded), not at every later tick.
    assert summary.reclaims == 0 and summary.replacements == 1
    fallbacks = gang.read_gang(state / "runs" / "run-a")["fallbacks"]
    assert bool(fallbacks) == (landed == "on_demand")


# --- bad input ---------------------------------------------------------------------------------
def test_unknown_zone_is_refused_before_training(state):
    cloud = provider(market("us-east-1a", [1] * 100_000))
    with pytest.raises(UnknownZoneError, match=r"zone 'mars-1a'.*us-east-1a"):
        run(state, request(zone="mars-1a"), provider=cloud)
    assert not (state / "runs" / "run-a" / "telemetry").exists(), "nothing trained"
    assert cloud.nodes() == []


def test_instance_type_the_provider_lacks_is_refused_before_training(state):
    cloud = provider(market("us-east-1a", [1] * 100_000))
    with pytest.raises(UnknownInstanceTypeError, match=r"'p2.xlarge'.*p3.2xlarge"):
        run(state, request(instance_type="p2.xlarge"), provider=cloud)
    assert not (state / "runs" / "run-a" / "telemetry").exists()


def test_unreachable_provider_is_refused_before_training(state, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    cloud = gang.provider_for_run("p3.2xlarge", "us-east-1", "aws",
                                  endpoint_url=f"http://127.0.0.1:{closed_port()}",
                                  connect_timeout_s=0.5)
    with pytest.raises(ProviderUnreachableError, match="TRAINWISE_EC2_ENDPOINT_URL"):
        run(state, request(zone="us-east-1a"), provider=cloud)
    assert not (state / "runs" / "run-a" / "telemetry").exists()


def test_replacement_launch_failing_mid_run_is_no_success(state):
    cloud = provider(market("us-east-1a", [1, 1, 1] + [0] * 100_000), seconds_per_tick=0.01)
    real_launch = cloud.launch

    def launch_once(*args, **kwargs):
        if cloud.nodes():
            raise LaunchFailedError("emulated", "us-east-1a", "p3.2xlarge", args[2], 1,
                                    "InsufficientInstanceCapacity (injected)")
        return real_launch(*args, **kwargs)

    cloud.launch = launch_once
    with pytest.raises(runs.RunInterruptedError) as caught:
        run(state, request(market="spot", zone="us-east-1a", max_steps=8), provider=cloud)
    summary = caught.value.summary
    assert summary.status != "completed" and summary.steps < 8
    assert "replacement launch failed" in summary.pending
    assert "InsufficientInstanceCapacity" in summary.pending
    # Nothing trained is lost: the stopped node's checkpoint is committed in the store.
    assert runs.store_status(runs_store(state), PARTITION, "run-a") == "resumable"


def runs_store(state):
    from trainwise.object_store import LocalObjectStore

    return LocalObjectStore(state / "objects")


def test_bad_market_and_node_count_are_refused_before_any_write(state):
    with pytest.raises(ValueError, match=r"market='cheap'.*spot"):
        run(state, request(market="cheap"))
    with pytest.raises(ValueError, match=r"nodes=0"):
        run(state, request(nodes=0))
    assert not (state / "runs").exists()


# --- the aws provider under the gang, against moto_server on loopback --------------------------
def test_aws_gang_launches_the_allocation_and_replaces_a_reclaimed_node(moto_url, aws_env,
                                                                          tmp_path):
    import signal

    import boto3

    from tests.test_cloud_provider_aws import REGION, _ec2_instance, _provider

    cloud = _provider(moto_url)
    session = gang.GangSession(cloud, gang.Allocation(market="spot", zone="us-east-1a"),
                               "p3.2xlarge", tmp_path / "run", "run-aws", region=REGION)
    [first] = session.start()
    ec2 = _ec2_instance(moto_url, first.node_id)
    assert ec2["InstanceLifecycle"] == "spot"
    assert ec2["Placement"]["AvailabilityZone"] == "us-east-1a"
    # The spot market takes the instance back; the session's check asks the training loop of
    # this process to stop (`training.loop.request_stop`), the loop's notice, and signals no one.
    from training._loop_fast import PreemptionSignal

    sent: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sent.append(signum))
    try:
        with PreemptionSignal() as notice:  # what the loop holds while it trains
            boto3.client("ec2", endpoint_url=moto_url, region_name=REGION).terminate_instances(
                InstanceIds=[first.node_id])
            session.check()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert notice.pending and notice.signal_name.startswith("provider notice (reclaim")
    assert sent == [] and session.reclaims == 1
    assert session.replace()
    [second] = session.nodes
    assert second.node_id != first.node_id
    assert _ec2_instance(moto_url, second.node_id)["InstanceLifecycle"] == "spot"
    record = session.close("completed")
    assert _ec2_instance(moto_url, second.node_id)["State"]["Name"] in ("shutting-down",
                                                                       "terminated")
    assert [n["node_id"] for n in record["launched"]] == [first.node_id, second.node_id]
    assert record["cost_usd"] >= 0 and record["provider"] == "aws"
