"""A registered job run by node agents on the EC2 nodes the aws provider launches (issue 27).

moto_server stands for EC2; `benchmarks.ec2_boot_double` runs each instance's user-data as
cloud-init would (its node paths in a temporary folder, its own IMDSv2 double). The launcher
(`trainwise.agent_launch.AgentJobLaunch`) writes the task, follows the agents through the store
only, answers a spot reclaim (the notice through the node's metadata, then EC2 terminating the
instance) with a replacement that resumes from the store, and fails a run whose agent refused
its task with the agent's reason; the Launchpad's asset takes this path on aws.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest

from benchmarks.ec2_boot_double import Ec2BootDouble
from telemetry.reader import read_run_events
from tests import servers
from trainwise import cost_summary, gang
from trainwise.agent.task import put_task, read_task, task_key
from trainwise.agent_launch import AgentJobLaunch, runs_on_nodes, task_for
from trainwise.object_store import LocalObjectStore
from trainwise.orphan_nodes import run_states
from trainwise.sdk.spec import RunSpec
from trainwise.user_project import JobSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plain_loop"
DDP_EXAMPLE = ROOT / "examples" / "ddp_loop"
REGION, ZONE, INSTANCE = "us-east-1", "us-east-1a", "p3.2xlarge"
MAX_STEPS = 40
STATE_KEY = "c4" * 32  # the deployment's key: every node gets it from the AMI's env file
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with servers.moto(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def aws(moto_url, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("TRAINWISE_PROVIDER", "aws")
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", moto_url)
    ec2 = boto3.client("ec2", endpoint_url=moto_url, region_name=REGION)
    monkeypatch.setenv("TRAINWISE_EC2_IMAGE_ID", ec2.describe_images()["Images"][0]["ImageId"])
    for name in ("TRAINWISE_EC2_IMAGE_PARAMETER", "TRAINWISE_EC2_SUBNET_IDS",
                 "TRAINWISE_EC2_SECURITY_GROUP_IDS", "TRAINWISE_EC2_INSTANCE_PROFILE",
                 "TRAINWISE_EC2_TAGS", "TRAINWISE_EC2_AGENT_COMMAND",
                 "TRAINWISE_NODE_PROJECT_DIR"):
        monkeypatch.delenv(name, raising=False)
    return ec2


def _job(sleep_s: float = 0.1) -> JobSpec:
    return JobSpec("blobs-classifier", "train.py", "script", EXAMPLE / "train.py", "blobs",
                   ("--max-steps", str(MAX_STEPS), "--checkpoint-every-steps", "10",
                    "--step-sleep-s", str(sleep_s)))


def _node_env() -> dict[str, str]:
    """The environment cloud-init starts the user-data in (the AMI's python has trainwise)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINWISE_", "AWS_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


AGENT_ENV = {"TRAINWISE_STATE_KEY": STATE_KEY, "TRAINWISE_AGENT_POLL_S": "0.2",
             "TRAINWISE_AGENT_TELEMETRY_EVERY_S": "1", "TRAINWISE_AGENT_NOTICE_MARGIN_S": "5"}


def _launch(tmp_path: Path, run_id: str, job: JobSpec, nodes: int = 1,
            project_dir: Path = EXAMPLE, store: str = "") -> AgentJobLaunch:
    store, run_dir = store or str(tmp_path / "store"), tmp_path / "runs" / run_id
    provider = gang.provider_for_run(INSTANCE, REGION, run_id=run_id, store_root=store,
                                     job=job.name)
    session = gang.GangSession(provider, gang.Allocation(market="spot", zone=ZONE, nodes=nodes,
                                                         reason="test", source="test"),
                               INSTANCE, run_dir, run_id, region=REGION)
    spec = RunSpec(run_id=run_id, run_dir=str(run_dir), max_steps=MAX_STEPS, seed=0,
                   checkpoint_every_steps=10, store_root=store)
    return AgentJobLaunch(job, project_dir, session, spec, boot_timeout_s=120.0, poll_s=0.2,
                          segment_timeout_s=TIMEOUT_S)


def _in_thread(launch: AgentJobLaunch) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = launch.run()
        except BaseException as error:  # noqa: BLE001 - re-raised by the test
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _wait_for_step(nodes, step: int, thread: threading.Thread, box: dict) -> None:
    """Until the job on one of `nodes` printed `step` (the launch still running)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not any(f"step {step}\n" in _job_log(node) for node in nodes):
        assert time.monotonic() < deadline and thread.is_alive(), (
            box, [n.log[-1500:] + _job_log(n)[-1500:] for n in nodes])
        time.sleep(0.1)


def _job_log(node) -> str:
    found = list((node.folder / "home" / "agent_runs").glob("*/agent/job.log"))
    return found[0].read_text(errors="replace") if found else ""


def test_the_job_runs_on_its_ec2_node_and_a_reclaim_resumes_on_the_replacement(
        aws, moto_url, tmp_path):
    run_id = "nodes-reclaim"
    assert runs_on_nodes()  # TRAINWISE_PROVIDER=aws: the asset takes this launcher
    launch = _launch(tmp_path, run_id, _job())
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id=run_id, env=_node_env(),
                       agent_env=AGENT_ENV) as double:
        thread, box = _in_thread(launch)
        [first] = double.wait_booted(1)
        _wait_for_step([first], 15, thread, box)
        # The launcher holds the run folder: the orphan sensor keeps the node however old
        # gang.json is (an hour from now here).
        states = run_states(tmp_path, time.time() + 3600.0)
        assert states[run_id].live and "holds the run" in states[run_id].why
        double.reclaim(first.instance_id, notice_s=20.0)
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "the launch did not end"
        assert double.errors == []
        booted = list(double.booted.values())
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result["status"] == "completed", (result["failure"], first.log[-3000:])
    assert result["engine"] == "node_agent" and result["steps"] == MAX_STEPS
    # Two launches: the first answered the notice (exit 143), the replacement finished.
    first_launch, second_launch = result["segments"]
    assert first_launch["returncode"] == 143 and first_launch["status"] == "preempted"
    assert second_launch["returncode"] == 0 and second_launch["status"] == "completed"
    [first_start] = first_launch["starts"].values()
    [second_start] = second_launch["starts"].values()
    stopped_at = first_start["last_committed_step"]
    assert first_start["state"] == "preempted" and stopped_at >= 15
    assert second_start["resumed_from_step"] == stopped_at
    assert second_start["last_committed_step"] == MAX_STEPS
    # Each launch ran on its own instance; the notice came from the node's metadata service.
    assert len(booted) == 2 and first.instance_id in first_launch["nodes"][0]
    status = json.loads((first.folder / "home" / "agent_runs" / run_id / "agent"
                         / "status.json").read_text())
    assert status["notice"]["source"] == "ec2 spot/instance-action"
    assert f"resumed True at step {stopped_at}" in _job_log(booted[1])
    # Nothing trained on the launching machine: its run folder holds no checkpoint.
    run_dir = tmp_path / "runs" / run_id
    assert not (run_dir / "checkpoints").exists()
    assert sorted(p.name for p in (run_dir / "telemetry" / run_id).iterdir()) == [
        "rank0", f"rank{gang.PROVIDER_RANK}"]
    # The agents' telemetry, copied from the store into the run folder: read as a local run's
    # (explain, the sensor, MLflow and Prometheus read this folder).
    events = read_run_events(run_dir / "telemetry" / run_id, rank=0)
    steps = [e["step"] for e in events if e["type"] == "step"]
    assert steps == list(range(1, MAX_STEPS + 1))
    assert [e["status"] for e in events if e["type"] == "run_end"] == ["preempted", "completed"]
    record = json.loads((run_dir / "gang.json").read_text())
    assert record["reclaims"] == 1 and record["replacements"] == 1
    # The node heard the notice first: recorded as the session records a reclaim it sees, its
    # segment's provider seconds ended then (both launches are in the trained time).
    [notice] = [h for h in record["history"] if h["event"] == "notice"]
    assert notice["reason"].startswith("reclaim: the node's agent answered its notice")
    assert record["train_provider_s"] >= 0.9 * (first_launch["wall_s"] + second_launch["wall_s"])
    # `explain --summary` names where the job ran, and its rows still close on the bill.
    summary = cost_summary.summarize(run_dir)
    assert record["runs_on"] == "node agents" and summary.engine == "node-agent"
    assert "(node-agent engine, bill from gang.json" in summary.text()
    assert summary.bill_usd == pytest.approx(record["cost_usd"])
    rows = {r.key: r for r in summary.rows}
    assert "billed as training" in rows["tail"].why_missing
    # Nothing billed runs idle: both instances are ended in EC2; the task is gone.
    states = {i["InstanceId"]: i["State"]["Name"] for r in aws.describe_instances(
        InstanceIds=[n.instance_id for n in booted])["Reservations"] for i in r["Instances"]}
    assert set(states.values()) <= {"shutting-down", "terminated"}, states
    assert not LocalObjectStore(tmp_path / "store").exists(task_key(run_id))


def test_the_job_on_its_node_checkpoints_to_the_s3_bucket_the_launcher_named(
        aws, moto_url, tmp_path, monkeypatch):
    # The deployment's bucket (TRAINWISE_S3_BUCKET): the launcher hands the nodes
    # s3://BUCKET/PREFIX; the node reaches it with its own credentials (the instance profile on
    # EC2; here the AMI's env file) and the endpoint override the AMI's env file gives.
    bucket, run_id = "trainwise-deploy", "nodes-s3"
    boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    monkeypatch.setenv("TRAINWISE_S3_ENDPOINT_URL", moto_url)
    launch = _launch(tmp_path, run_id, _job(sleep_s=0.02), store=f"s3://{bucket}/team-a")
    node_s3 = {"TRAINWISE_S3_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id=run_id, env=_node_env(),
                       agent_env={**AGENT_ENV, **node_s3}) as double:
        result = launch.run()
        assert double.errors == []
    assert result["status"] == "completed", result["failure"]
    [segment] = result["segments"]
    [start] = segment["starts"].values()
    assert start["last_committed_step"] == MAX_STEPS
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=moto_url, region_name=REGION)
            .list_objects_v2(Bucket=bucket, Prefix=f"team-a/runs/{run_id}/")["Contents"]]
    assert f"team-a/{task_key(run_id)}" not in keys  # taken back when the launch ended
    assert any(k.endswith("/status.json") for k in keys)
    assert f"team-a/runs/{run_id}/checkpoints/rank0/step-{MAX_STEPS:07d}.pt.commit" in keys
    # Nothing of the run is in a folder store; its telemetry came back through the bucket.
    assert not (tmp_path / "store").exists()
    events = read_run_events(tmp_path / "runs" / run_id / "telemetry" / run_id, rank=0)
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(1, MAX_STEPS + 1))


def test_the_slow_layers_new_allocation_moves_a_remote_run(aws, moto_url, tmp_path):
    """The slow layer writes a new allocation for the live run (on-demand instead of spot):
    the launcher terminates the spot instance, whose agent checkpoints on the shutdown's
    SIGTERM, and launches the on-demand one, which resumes from the store and completes."""
    run_id = "nodes-move"
    launch = _launch(tmp_path, run_id, _job())
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id=run_id, env=_node_env(),
                       agent_env=AGENT_ENV) as double:
        thread, box = _in_thread(launch)
        [first] = double.wait_booted(1)
        _wait_for_step([first], 12, thread, box)
        gang.write_allocation(tmp_path / "runs" / run_id, gang.Allocation(
            market="on_demand", zone=ZONE, nodes=1, reason="test: the market turned",
            source="slow_tick"))
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "the launch did not end"
        booted = list(double.booted.values())
    result = box["result"]
    assert result["status"] == "completed", result["failure"]
    first_launch, second_launch = result["segments"]
    assert first_launch["stop_reason"].startswith("allocation: 1 x on_demand")
    assert "(spot in" in first_launch["nodes"][0] and "(on_demand in" in second_launch["nodes"][0]
    [stopped] = first_launch["starts"].values()
    [resumed] = second_launch["starts"].values()
    assert stopped["state"] == "preempted" and stopped["last_committed_step"] >= 12
    assert resumed["resumed_from_step"] == stopped["last_committed_step"]
    assert resumed["last_committed_step"] == MAX_STEPS and len(booted) == 2
    status = json.loads((first.folder / "home" / "agent_runs" / run_id / "agent"
                         / "status.json").read_text())
    assert status["notice"]["source"] == "SIGTERM"  # the instance's shutdown
    record = json.loads((tmp_path / "runs" / run_id / "gang.json").read_text())
    assert record["reclaims"] == 0 and record["replacements"] == 1


def test_a_task_the_node_refuses_fails_the_run_with_the_agents_reason(
        aws, moto_url, tmp_path, monkeypatch):
    run_id = "nodes-refused"
    empty = tmp_path / "image-without-the-project"
    empty.mkdir()
    monkeypatch.setenv("TRAINWISE_NODE_PROJECT_DIR", str(empty))
    launch = _launch(tmp_path, run_id, _job())
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id=run_id, env=_node_env(),
                       agent_env=AGENT_ENV) as double:
        result = launch.run()
        [node] = double.booted.values()
    assert result["status"] == "failed" and len(result["segments"]) == 1
    assert result["segments"][0]["returncode"] == 2
    assert "refused" in result["failure"] and "job.entry" in result["failure"]
    assert str(empty) in result["failure"]
    state = aws.describe_instances(InstanceIds=[node.instance_id])[
        "Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated")


def test_a_job_that_never_calls_step_on_its_node_is_stopped_with_the_fix(aws, moto_url, tmp_path):
    run_id = "nodes-silent"
    project = tmp_path / "team"
    project.mkdir()
    (project / "silent.py").write_text("import time\ntime.sleep(600)\n")
    job = JobSpec("silent", "silent.py", "script", project / "silent.py", "blobs", ())
    launch = _launch(tmp_path, run_id, job, project_dir=project)
    launch.first_step_timeout_s, launch.telemetry_every_s = 6.0, 1.0
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id=run_id, env=_node_env(),
                       agent_env=AGENT_ENV) as double:
        result = launch.run()
        booted = list(double.booted.values())
    assert result["status"] == "failed" and len(result["segments"]) == 1
    assert "called run.step() not once in 6 s on its node(s)" in result["failure"]
    assert "docs/sdk.md" in result["failure"]
    # The job was running (its agent said so) and its node is ended: nothing left billing.
    [start] = result["segments"][0]["starts"].values()
    assert start["state"] == "running"
    states = {i["State"]["Name"] for r in aws.describe_instances(
        InstanceIds=[n.instance_id for n in booted])["Reservations"] for i in r["Instances"]}
    assert states <= {"shutting-down", "terminated"}, states


def test_a_gangs_task_names_the_first_nodes_private_address(aws, tmp_path):
    run_id = "nodes-gang"
    launch = _launch(tmp_path, run_id, _job(), nodes=3)
    nodes = launch.session.start()
    try:
        address = launch.session.provider.node_address(nodes[0])
        assert address and address.count(".") == 3
        gang_spec = launch._gang(4)
        assert (gang_spec.nodes, gang_spec.procs_per_node) == (3, 1)
        assert gang_spec.rdzv_endpoint == f"{address}:29400"
        assert gang_spec.rdzv_id == f"{run_id}-launch-4"
        store = LocalObjectStore(tmp_path / "store")
        put_task(store, task_for(launch.job, str(EXAMPLE), launch.spec, gang_spec))
        task = read_task(store, run_id)
        assert task.gang == gang_spec and task.spec["max_steps"] == MAX_STEPS
        assert "store_root" not in task.spec and "run_dir" not in task.spec
    finally:
        launch.session.close("test over")


@pytest.fixture
def cluster():
    with servers.netns_cluster() as built:  # a fresh bridge: each test its own subnet
        yield built


@pytest.mark.slow  # 50 s; make test keeps the netns gang's reclaim and this file's aws reclaim
def test_a_gang_on_aws_trains_across_its_instances_and_is_relaunched_after_a_reclaim(
        aws, moto_url, tmp_path, monkeypatch, cluster):
    """Three instances in one subnet, each booted in a network namespace at its private IPv4:
    the launcher's task puts the gang's rendezvous at the first instance's address, each agent
    learns its own from IMDSv2's local-ipv4, and torchrun trains across them over the bridge.
    A reclaim of the second instance stops every rank at one committed step; the launcher
    relaunches the gang on three new instances, which resume from the store."""
    vpc = aws.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    subnet = aws.create_subnet(VpcId=vpc, CidrBlock="10.9.0.0/16",
                               AvailabilityZone=ZONE)["Subnet"]["SubnetId"]
    monkeypatch.setenv("TRAINWISE_EC2_SUBNET_IDS", subnet)
    run_id, steps = "nodes-gang-run", 16
    job = JobSpec("ddp-blobs", "train.py", "script", DDP_EXAMPLE / "train.py", "blobs",
                  ("--max-steps", str(steps), "--checkpoint-every-steps", "4",
                   "--step-sleep-s", "0.3"))
    launch = _launch(tmp_path, run_id, job, nodes=3, project_dir=DDP_EXAMPLE)
    launch.spec = dataclasses.replace(launch.spec, max_steps=steps, checkpoint_every_steps=4,
                                      collective_timeout_s=30.0)
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id=run_id, env=_node_env(),
                       agent_env={**AGENT_ENV, "GLOO_SOCKET_IFNAME": "eth0"}, cluster=cluster,
                       gateway="10.9.255.254", prefix=16) as double:
        thread, box = _in_thread(launch)
        first_gang = double.wait_booted(3, timeout_s=120)
        _wait_for_step(first_gang, 5, thread, box)
        double.reclaim(first_gang[1].instance_id, notice_s=30.0)
        thread.join(TIMEOUT_S * 2)
        assert not thread.is_alive(), "the launch did not end"
        assert double.errors == []
        booted = list(double.booted.values())
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result["status"] == "completed", (
        result["failure"], [n.log[-1500:] + _job_log(n)[-1500:] for n in booted])
    first, second = result["segments"]
    assert first["returncode"] == 143 and second["returncode"] == 0
    assert len(first["starts"]) == len(second["starts"]) == 3
    stopped = {s["last_committed_step"] for s in first["starts"].values()}
    assert len(stopped) == 1 and next(iter(stopped)) >= 5  # every rank at one step
    assert {s["resumed_from_step"] for s in second["starts"].values()} == stopped
    assert {s["state"] for s in second["starts"].values()} == {"completed"}
    # Each launch's rendezvous was its first instance's private address; every host learned
    # its own address from the metadata service.
    addresses = {n.instance_id: n.host.addr for n in booted}
    assert len(booted) == 6
    for segment in (first, second):
        head = segment["nodes"][0].split()[0]
        assert segment["gang"] == f"{addresses[head]}:29400"
    for node in booted:
        status = json.loads(next((node.folder / "home" / "agent_runs").glob(
            "*/agent/status.json")).read_text())
        assert status["node_addr"] == node.host.addr
    assert json.loads((tmp_path / "runs" / run_id / "gang.json").read_text())["reclaims"] == 1


def test_a_host_whose_boot_fails_is_named_and_nothing_is_left_running(
        aws, moto_url, tmp_path, monkeypatch, cluster):
    """A 2-instance gang whose second instance's user-data fails (the AMI has no agent): the
    first host waits for it to join until the rendezvous times out, and the run fails naming
    the instance that never reported; both instances are terminated."""
    vpc = aws.create_vpc(CidrBlock="10.8.0.0/16")["Vpc"]["VpcId"]
    subnet = aws.create_subnet(VpcId=vpc, CidrBlock="10.8.0.0/16",
                               AvailabilityZone=ZONE)["Subnet"]["SubnetId"]
    monkeypatch.setenv("TRAINWISE_EC2_SUBNET_IDS", subnet)
    run_id = "nodes-gang-broken"
    job = JobSpec("ddp-blobs", "train.py", "script", DDP_EXAMPLE / "train.py", "blobs",
                  ("--max-steps", "8"))
    launch = _launch(tmp_path, run_id, job, nodes=2, project_dir=DDP_EXAMPLE)
    launch.join_timeout_s = 15.0
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id=run_id, env=_node_env(),
                       agent_env={**AGENT_ENV, "GLOO_SOCKET_IFNAME": "eth0"}, cluster=cluster,
                       gateway="10.8.255.254", prefix=16, broken_boots=(1,)) as double:
        result = launch.run()
        booted = list(double.booted.values())
    assert result["status"] == "failed"
    broken = booted[1].instance_id
    assert f"no agent reported from node(s) {broken}" in result["failure"]
    assert booted[0].instance_id not in result["failure"].split("no agent reported")[1]
    [start] = result["segments"][0]["starts"].values()
    assert start["state"] == "failed"
    states = {i["InstanceId"]: i["State"]["Name"] for r in aws.describe_instances(
        InstanceIds=[n.instance_id for n in booted])["Reservations"] for i in r["Instances"]}
    assert set(states.values()) <= {"shutting-down", "terminated"}, states


def _agent(tmp_path: Path, run_id: str, wait_s: str) -> tuple[subprocess.Popen, Path]:
    env = {**_node_env(), **AGENT_ENV, "TRAINWISE_AGENT_TASK_WAIT_S": wait_s,
           "TRAINWISE_HOME": str(tmp_path / "home")}
    log = tmp_path / f"{run_id}.log"
    with open(log, "wb") as output:
        process = subprocess.Popen([sys.executable, "-m", "trainwise.agent", "--store",
                                    str(tmp_path / "store"), "--run-id", run_id], cwd=ROOT,
                                   env=env, stdout=output, stderr=subprocess.STDOUT)
    return process, log


def test_an_agent_waits_for_a_task_written_after_its_boot(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    spec = RunSpec(run_id="late-task", run_dir=str(tmp_path / "x"), max_steps=3)
    agent, log = _agent(tmp_path, "late-task", "60")
    deadline = time.monotonic() + 60
    while "waiting up to 60 s for the task" not in log.read_text():
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    job = JobSpec("blobs-classifier", "missing.py", "script", None, "blobs")
    put_task(store, task_for(job, str(EXAMPLE), spec))
    assert agent.wait(timeout=60) == 2, log.read_text()
    assert "'missing.py'" in log.read_text()  # it read the task: the entry is not on this node

    never, log = _agent(tmp_path, "never-written", "0.5")
    assert never.wait(timeout=60) == 2 and "does not exist" in log.read_text()




def test_the_launchpads_job_on_aws_runs_on_the_node_and_is_logged_from_its_telemetry(
        aws, moto_url, tmp_path, monkeypatch):
    """The path a user runs: `user_job_run` materialized through Dagster with
    TRAINWISE_PROVIDER=aws; the job runs on the booted instance (its agent), MLflow gets the
    train loss from the telemetry the launcher copied back."""
    import dagster as dg
    from mlflow.tracking import MlflowClient

    from assets.data import data_shards_asset
    from assets.partitions import partitions_for
    from assets.resources import MLflowResource, ObjectStoreResource, StateResource
    from assets.user_jobs import user_job_defs
    from tests.test_user_job_asset import write_project
    from trainwise.user_project import load_project_file

    project = load_project_file(write_project(tmp_path / "team"))
    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRAINWISE_INSTANCE_TYPE", INSTANCE)
    monkeypatch.setenv("TRAINWISE_REGION", REGION)
    shards = data_shards_asset(partitions_for(project), project.datasets)
    [asset] = user_job_defs(project, shards)["assets"]
    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    resources = {"state": StateResource(home=str(tmp_path / "home")),
                 "object_store": ObjectStoreResource(local_root=str(tmp_path / "store")),
                 "mlflow": MLflowResource(tracking_uri=mlflow_uri)}
    assert dg.materialize([shards], partition_key="points", resources=resources).success
    with Ec2BootDouble(moto_url, REGION, tmp_path / "nodes", run_id="fit-aws", env=_node_env(),
                       agent_env=AGENT_ENV) as double:
        result = dg.materialize(
            [shards.to_source_asset(), asset], resources=resources,
            run_config={"ops": {"user_job_run": {"config": {
                "job": "fit", "run_id": "fit-aws", "max_steps": 30, "market": "on_demand",
                "checkpoint_every_steps": 10}}}})
        [node] = double.booted.values()
    assert result.success
    [materialization] = result.asset_materializations_for_node("user_job_run")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["status"] == "completed" and meta["steps"] == 30 and meta["reclaims"] == 0
    [launch] = meta["segments"]
    assert node.instance_id in launch["nodes"][0] and launch["returncode"] == 0
    # The job ran in the node's folder, on the shards the launching machine materialized.
    job_log = _job_log(node)
    assert json.loads(job_log.strip().splitlines()[-1])["train_rows"] > 0
    logged = MlflowClient(mlflow_uri).get_run(meta["mlflow_run_id"])
    history = MlflowClient(mlflow_uri).get_metric_history(logged.info.run_id, "losses/train")
    assert sorted(m.step for m in history) == list(range(1, 31))
    assert logged.data.metrics["cost/bill_usd"] == pytest.approx(meta["cost_usd"])
