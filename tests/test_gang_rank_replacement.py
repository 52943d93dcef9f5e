"""Issue 11 item 5 to its end: a reclaim notice for the node of one rank of a torchrun gang run
through the emulated provider is answered by the whole gang (one step boundary, one checkpoint,
uploaded to the object store), the provider releases that node and launches a replacement
(which node, zone, market and why are recorded), and the gang restarts from the store's
checkpoint and finishes with the same model as a run that met no notice.

The reclaim comes from a replayed market: a short array standing for a trace window whose spot
capacity drops from 2 nodes to 1 at tick 3; the provider reclaims the newest spot node, rank 1's.
With one spot node left in use and capacity 1, the replacement's spot launch is refused and it
comes up on-demand in the same zone (a recorded fallback).

Tolerance: none. The checkpoint holds the model, the optimizer, every rank's RNG and sampler
position, and the gang resumes at the same world size, so the resumed run takes exactly the
same float operations as the uninterrupted one: its final weights are bit-identical
(`torch.equal`), as tests/test_training_ddp.py shows for the loss sequence.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cloud import emulated as replay
from cloud.providers import NodeHandle, NodeState
from cloud.providers.emulated import EmulatedProvider
from telemetry.reader import read_run_events
from tests.test_training_ddp import free_port
from tests.test_training_loop import TINY_GPT, tiny_config
from training.checkpoint import load_checkpoint
from training.ddp_worker import model_spec, torchrun_command
from trainwise import gang, torchrun_gang

REPO = Path(__file__).resolve().parents[1]
ZONE, INSTANCE = "us-east-1a", "p3.2xlarge"
MAX_STEPS = 8
DROP_TICK = 3  # spot capacity 2 -> 1: the boot ends at 360 s (tick 1), the drop at 585 s


def market(available: list[int]) -> replay.ReplayMarket:
    return replay.ReplayMarket(ZONE, INSTANCE, 195, np.asarray(available, dtype=np.int64), 0,
                               "test window", 0.918, 3.06, "test")


def provider(available: list[int], seconds_per_tick: float) -> EmulatedProvider:
    return EmulatedProvider([market(available)], replay.ReplayClock(195.0, seconds_per_tick),
                            replay.default_rules())


def session(cloud: EmulatedProvider, run_dir: Path, nodes: int = 2) -> gang.GangSession:
    allocation = gang.Allocation(market="spot", zone=ZONE, nodes=nodes,
                                 reason="test gang", source="test")
    return gang.GangSession(cloud, allocation, INSTANCE, run_dir, "gang")


# --- unit level: the session replaces only the noticed node ------------------------------------
def test_reclaim_of_one_nodes_rank_replaces_only_that_node_in_its_place(tmp_path):
    cloud = provider([2] * DROP_TICK + [1] * 10_000, seconds_per_tick=0.01)
    gang_session = session(cloud, tmp_path)
    told: list[tuple[list[str], str]] = []

    def on_stop(nodes: list[NodeHandle], reason: str) -> dict[str, Any]:
        told.append(([n.node_id for n in nodes], reason))
        return {"what": f"SIGTERM to {len(nodes)} rank(s)"}

    gang_session.on_stop = on_stop
    first, second = gang_session.start()
    gang_session.resume_clock()
    deadline = time.monotonic() + 10
    while not told and time.monotonic() < deadline:
        time.sleep(0.02)
        gang_session.check()
    assert told == [([second.node_id], told[0][1])], "only rank 1's node is told"
    assert told[0][1].startswith("reclaim") and "trace tick 3" in told[0][1]
    gang_session.check()  # the clock waits for the gang's checkpoint: nothing told twice
    assert len(told) == 1

    assert gang_session.replace_noticed()
    assert gang_session.nodes[0] == first, "rank 0 keeps its node"
    new = gang_session.nodes[1]
    assert new not in (first, second) and (new.zone, new.market) == (ZONE, "on_demand")
    assert cloud.state(first).alive and cloud.state(second) == NodeState.RECLAIMED
    assert cloud.state(new) == NodeState.RUNNING, "booted: the changeover was waited"
    launch = gang_session.history[-1]
    assert launch["event"] == "launch" and launch["replaces"] == second.node_id
    assert (launch["rank"], launch["zone"], launch["market"]) == (1, ZONE, "on_demand")
    assert launch["why"].startswith("reclaim") and "spot node(s) free" in launch["source"]
    assert gang_session.fallbacks == [
        f"spot refused in {ZONE} ({launch['source'][len('fallback: '):]}): on-demand instead "
        "for rank 1"]
    assert (gang_session.reclaims, gang_session.replacements) == (1, 1)
    record = gang_session.close("completed")
    assert [e["event"] for e in record["history"]] == ["launch", "notice", "launch"]
    assert record["history"][1]["noticed"] == [second.node_id]
    assert not any(cloud.state(n).alive for n in cloud.nodes()), "all released at the end"


def test_a_gang_of_one_node_per_rank_is_required(tmp_path):
    gang_session = session(provider([2] * 100, 0.01), tmp_path, nodes=1)
    driver = torchrun_gang.TorchrunGang(gang_session, {}, tmp_path, tmp_path / "store", "ckpt", nproc=2)
    with pytest.raises(ValueError, match=r"1 node\(s\) for 2 rank\(s\).*nodes=2"):
        driver.run()


class FakeSegments:
    """The driver's torchrun segments, faked: the first trains until the provider's notice and
    stops preempted at step 3, the next completes (or each ends as `outcomes` say)."""

    def __init__(self, driver: torchrun_gang.TorchrunGang, outcomes: list[str]) -> None:
        self.driver, self.outcomes, self.resumed = driver, list(outcomes), []
        self.told: list[list[int]] = []
        driver._segment = self.segment  # type: ignore[method-assign]
        driver._tell = self.tell  # type: ignore[method-assign]
        driver._restore = lambda rank0: str(driver.work_dir / "restored")  # type: ignore

    def tell(self, nodes: list[NodeHandle], reason: str) -> dict[str, Any]:
        self.told.append([self.driver.session.nodes.index(n) for n in nodes])
        return {"what": "told", "ranks": self.told[-1]}

    def segment(self, index: int, resume_from: str | None) -> list[dict[str, Any]]:
        self.resumed.append(resume_from)
        outcome = self.outcomes.pop(0)
        if outcome == "preempted":
            self.driver.session.resume_clock()
            deadline = time.monotonic() + 10
            while not self.driver.session.stop_reason and time.monotonic() < deadline:
                time.sleep(0.02)
                self.driver.session.check()
        self.driver.segments.append({"index": index})
        if outcome == "error":
            return [{"error": "ValueError: bad spec"}, {"error": "RuntimeError: rank 0 failed"}]
        status = "preempted" if outcome.startswith("preempted") else outcome
        return [{"status": status, "steps": 3 if status == "preempted" else 8}] * 2


def test_the_driver_replaces_the_noticed_rank_and_resumes_from_the_restored_disk(tmp_path):
    cloud = provider([2] * DROP_TICK + [1] * 10_000, seconds_per_tick=0.01)
    driver = torchrun_gang.TorchrunGang(session(cloud, tmp_path / "run"), {}, tmp_path / "work",
                               tmp_path / "store", "ckpt", nproc=2)
    fake = FakeSegments(driver, ["preempted", "completed"])
    found = driver.run()
    assert found["status"] == "completed" and not found["failure"]
    assert fake.told == [[1]] and fake.resumed == [None, str(tmp_path / "work" / "restored")]
    events = [(e["event"], e.get("rank")) for e in found["gang"]["history"]]
    assert events == [("launch", None), ("notice", None), ("launch", 1)]
    assert not any(cloud.state(n).alive for n in cloud.nodes())


@pytest.mark.parametrize("outcome, why", [
    ("error", "rank 0: ValueError: bad spec; rank 1: RuntimeError: rank 0 failed"),
    ("preempted-by-nobody", "without a stop of ours"),
])
def test_a_gang_that_ends_otherwise_is_interrupted_never_completed(tmp_path, outcome, why):
    cloud = provider([2] * 10_000, seconds_per_tick=0.01)
    driver = torchrun_gang.TorchrunGang(session(cloud, tmp_path / "run"), {}, tmp_path / "work",
                               tmp_path / "store", "ckpt", nproc=2)
    FakeSegments(driver, [outcome if outcome == "error" else "preempted-nobody"])
    found = driver.run()
    assert found["status"] == "interrupted" and why in found["failure"]
    assert found["gang"]["replacements"] == 0
    assert not any(cloud.state(n).alive for n in cloud.nodes()), "nodes released"


# --- end to end: 2 ranks under torchrun, through the provider ----------------------------------
def spec(out_dir: Path, micro_batch_ms: float) -> dict[str, Any]:
    config = tiny_config(max_steps=MAX_STEPS, grad_accum_steps=4, fast_every_steps=2,
                         eval_every_steps=4, checkpoint_every_steps=0, price_usd_per_hour=0.0,
                         run_id="gang")
    values = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    values["model"] = model_spec(TINY_GPT)
    return {"examples": "tests.test_training_loop:text_examples", "config": values,
            "out_dir": str(out_dir), "policy": {"kind": "fixed_shares", "shares": [0.75, 0.25]},
            # Emulated device time (sleeps, same numerics): steps of >= 0.45 s leave the notice
            # time to land mid-run on a loaded machine.
            "micro_batch_ms": micro_batch_ms}


@pytest.fixture(scope="module")
def gang_runs(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("gang")
    # The reference: the same training under plain torchrun, no provider, no notice.
    reference_spec = {**spec(tmp / "reference", 0.0), "result_dir": str(tmp / "reference-out")}
    (tmp / "reference.json").write_text(json.dumps(reference_spec))
    reference = subprocess.Popen(
        torchrun_command(tmp / "reference.json", 2, free_port()), cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cloud = provider([2] * DROP_TICK + [1] * 10_000, seconds_per_tick=0.5)
    driver = torchrun_gang.TorchrunGang(session(cloud, tmp / "run"), spec(tmp / "run", 150.0),
                               tmp / "work", tmp / "store", "checkpoints/gang", nproc=2,
                               timeout_s=240)
    found = driver.run()
    _, stderr = reference.communicate(timeout=240)
    found["reference"] = [json.loads((tmp / "reference-out" / f"rank{r}.json").read_text())
                          for r in (0, 1)]
    found.update(tmp=tmp, cloud=cloud, reference_stderr=stderr[-3000:])
    return found


@pytest.mark.slow
def test_one_ranks_reclaim_replaces_its_node_and_the_gang_finishes_from_the_store(gang_runs):
    found = gang_runs
    logs = [(found["tmp"] / "work" / f"segment-{i}.log") for i in range(len(found["segments"]))]
    assert found["status"] == "completed", (found["failure"], [p.read_text()[-2000:]
                                                               for p in logs])
    first, second = found["segments"]
    # The whole gang stopped at one step boundary, and resumed from there.
    assert first["status"] == ["preempted", "preempted"]
    stopped = first["steps"][0]
    assert first["steps"] == [stopped, stopped] and 1 <= stopped < MAX_STEPS
    assert second["status"] == ["completed", "completed"]
    assert second["steps"] == [MAX_STEPS, MAX_STEPS]
    # One checkpoint at that boundary, written by rank 0 for the preemption, and it was the
    # store's copy (verified against its commit marker) that the replacement gang resumed from.
    telemetry = found["tmp"] / "run" / "telemetry" / "gang"
    written = [(e["rank"], e["reason"]) for e in read_run_events(telemetry)
               if e["type"] == "checkpoint" and e["step"] == stopped]
    assert written == [(0, "preemption")]
    history = found["gang"]["history"]
    assert [e["event"] for e in history] == ["launch", "notice", "launch", "restore"]
    notice, replacement, restore = history[1:]
    # The notice went to rank 1's node, and only rank 1 was signalled.
    assert notice["ranks"] == [1] and notice["noticed"] == [history[0]["nodes"][1]]
    assert (restore["source"], restore["step"]) == ("store", stopped)
    # Rank 1's node was released and replaced: which node, zone, market and why are recorded.
    assert replacement["replaces"] == history[0]["nodes"][1] and replacement["rank"] == 1
    assert (replacement["zone"], replacement["market"]) == (ZONE, "on_demand")
    assert replacement["why"].startswith("reclaim") and "fallback" in replacement["source"]
    gang_record = found["gang"]
    assert (gang_record["reclaims"], gang_record["replacements"]) == (1, 1)
    assert [(n["market"], n["node_id"]) for n in gang_record["launched"]] == [
        ("spot", history[0]["nodes"][0]), ("spot", history[0]["nodes"][1]),
        ("on_demand", replacement["nodes"][0])]
    assert gang_record["cost_usd"] > 0 and 0 < gang_record["spot_share"] < 1
    # Both ranks' notices name rank 1 (the rank that got the signal).
    notices = [e for e in read_run_events(telemetry) if e["type"] == "preemption"]
    assert sorted((e["rank"], e["signal_name"]) for e in notices) == [
        (0, "SIGTERM to rank 1 (gang notice)"), (1, "SIGTERM")]


@pytest.mark.slow
def test_the_replaced_gangs_model_is_bit_identical_to_a_run_without_the_notice(gang_runs):
    found = gang_runs
    assert all("error" not in r for r in found["reference"]), found["reference_stderr"]
    final = load_checkpoint(Path(found["results"][0]["checkpoint_path"]))
    reference = load_checkpoint(Path(found["reference"][0]["checkpoint_path"]))
    assert final["step"] == reference["step"] == MAX_STEPS
    for key, value in reference["model"].items():
        assert torch.equal(final["model"][key], value), key
    losses = [[e["train_loss"] for e in read_run_events(found["tmp"] / name / "telemetry" / "gang",
                                                        rank=0) if e["type"] == "step"]
              for name in ("run", "reference")]
    assert losses[0] == losses[1]


def test_worker_refuses_a_store_without_its_root(tmp_path):
    from training.ddp_worker import checkpoint_uploader

    assert checkpoint_uploader(None, 0) is None
    store = {"uploader": "trainwise.object_store:local_checkpoint_uploader",
             "root": str(tmp_path), "key_prefix": "k"}
    assert checkpoint_uploader(store, 1) is None  # rank 1
    assert checkpoint_uploader(store, 0) is not None
    with pytest.raises(ValueError, match="root"):
        checkpoint_uploader({"uploader": store["uploader"], "key_prefix": "k"}, 0)
