"""The SDK for a user's own plain PyTorch loop (trainwise.init / dataloader / track / step).

The resume checks run the user's script in a child process and stop it with a real SIGTERM (or
the node agent's notice file): the child must commit a checkpoint to the object store, exit with
the preemption code, and a resumed run must end with the same weights, bit for bit, as a run
that was never interrupted.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from telemetry.reader import list_segments, read_segment_lines
from training.checkpoint import load_checkpoint
from training.consumption import consumption_path, read_consumption
from trainwise.sdk import Capabilities, ModelChangedError, Preempted, Run
from trainwise.sdk.data import DataChangedError, ResumableBatchSampler
from trainwise.sdk.spec import RunSpec, RunSpecError, read_spec, write_spec
from trainwise.sdk.state import StateNotSaveableError

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = """
import sys, time, torch, trainwise
torch.set_num_threads(1)
torch.manual_seed(0)
x = torch.randn(240, 8)
y = x @ torch.randn(8, 1)
data = torch.utils.data.TensorDataset(x, y)
run = trainwise.init()
loader = run.dataloader(data, batch_size=16)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = run.track(model, optimizer)
print("started", run.step_count, flush=True)
while not run.done:
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss=loss, samples=len(xb))
        print("step", run.step_count, flush=True)
        time.sleep(float(sys.argv[2]))
        if run.done:
            break
run.finish(eval_loss=float(loss))
torch.save(model.state_dict(), sys.argv[1])
"""


def _spec(tmp_path: Path, name: str, **fields) -> Path:
    values = dict(run_id=name, run_dir=tmp_path / name, max_steps=45, seed=3,
                  checkpoint_every_steps=10, store_root=tmp_path / "store", store_prefix="")
    values.update(fields)
    return write_spec(RunSpec(**values), tmp_path / f"{name}.spec.json")


def _child_env(spec_path: Path) -> dict:
    return {**os.environ, "TRAINWISE_RUN_SPEC": str(spec_path), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT)}


def _run_to_end(script: Path, spec_path: Path, weights: Path, sleep_s: float = 0.0):
    return subprocess.run([sys.executable, str(script), str(weights), str(sleep_s)],
                          env=_child_env(spec_path), capture_output=True, text=True, timeout=300)


def _interrupt_at(script: Path, spec_path: Path, weights: Path, step: int, how, sleep_s=0.05):
    """Start the job, wait until it printed `step`, deliver the notice with `how`, wait it out."""
    child = subprocess.Popen([sys.executable, str(script), str(weights), str(sleep_s)],
                             env=_child_env(spec_path), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    for line in child.stdout:
        if line.strip() == f"step {step}":
            how(child)
            break
    out, err = child.communicate(timeout=300)
    return child.returncode, out, err


def _same_weights(a: Path, b: Path) -> None:
    left = torch.load(a, weights_only=True)
    right = torch.load(b, weights_only=True)
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), f"{key} differs after the resume"


def _events(run_dir: Path) -> list[dict]:
    events = []
    for segment in list_segments(run_dir / "telemetry" / run_dir.name):
        events.extend(event for _, event in read_segment_lines(segment))
    return events


@pytest.fixture
def user_script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(USER_SCRIPT)
    return path


@pytest.fixture
def reference(tmp_path, user_script):
    """The uninterrupted run's final weights."""
    weights = tmp_path / "reference.pt"
    done = _run_to_end(user_script, _spec(tmp_path, "reference"), weights)
    assert done.returncode == 0, done.stderr
    return weights


def test_sigterm_mid_epoch_checkpoints_exits_143_and_resumes_bit_identical(
        tmp_path, user_script, reference):
    spec_path = _spec(tmp_path, "job")
    weights = tmp_path / "job.pt"
    code, out, err = _interrupt_at(user_script, spec_path, weights, 23,
                                   lambda child: child.send_signal(signal.SIGTERM))
    assert code == 143, err
    assert not weights.exists()
    run_dir = tmp_path / "job"
    outcome = json.loads((run_dir / "outcome-rank0.json").read_text())
    assert outcome["status"] == "preempted"
    left_at = outcome["step"]
    assert 23 <= left_at < 45  # mid-run, past the step it was told at (15 examples per epoch)
    state = load_checkpoint(Path(outcome["checkpoint"]))
    assert state["step"] == left_at
    assert (tmp_path / "store" / "runs" / "job" / "checkpoints" / "rank0").is_dir()
    preemptions = [e for e in _events(run_dir) if e["type"] == "preemption"]
    assert preemptions and preemptions[0]["signal_name"] == "SIGTERM"
    assert preemptions[0]["response"].startswith("checkpoint_and_exit")

    resumed = _run_to_end(user_script, spec_path, weights)
    assert resumed.returncode == 0, resumed.stderr
    assert f"started {left_at}" in resumed.stdout
    _same_weights(reference, weights)


def test_resume_from_the_object_store_when_the_node_lost_its_disk(
        tmp_path, user_script, reference):
    spec_path = _spec(tmp_path, "job")
    weights = tmp_path / "job.pt"
    code, _, err = _interrupt_at(user_script, spec_path, weights, 17,
                                 lambda child: child.send_signal(signal.SIGTERM))
    assert code == 143, err
    shutil.rmtree(tmp_path / "job" / "checkpoints")  # a new node: nothing local survives
    resumed = _run_to_end(user_script, spec_path, weights)
    assert resumed.returncode == 0, resumed.stderr
    assert "started 0" not in resumed.stdout
    _same_weights(reference, weights)


def test_notice_file_of_the_node_agent_is_answered_like_a_sigterm(
        tmp_path, user_script, reference):
    notice = tmp_path / "node" / "interruption-notice"
    spec_path = _spec(tmp_path, "job", notice_file=notice, notice_s=30.0)
    weights = tmp_path / "job.pt"

    def write_notice(child):
        notice.parent.mkdir(parents=True, exist_ok=True)
        notice.write_text("terminate\n")

    code, _, err = _interrupt_at(user_script, spec_path, weights, 12, write_notice)
    assert code == 143, err
    preemptions = [e for e in _events(tmp_path / "job") if e["type"] == "preemption"]
    assert preemptions[0]["signal_name"] == "notice_file"
    notice.unlink()  # the replacement node has no notice
    resumed = _run_to_end(user_script, spec_path, weights)
    assert resumed.returncode == 0, resumed.stderr
    _same_weights(reference, weights)


# -- in-process: the run's records and its refusals ---------------------------------------------

def _data(n=64):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def _run(tmp_path, **fields) -> Run:
    values = dict(run_id="local", run_dir=tmp_path / "local", max_steps=12, seed=0,
                  checkpoint_every_steps=5, fast_every_steps=4)
    values.update(fields)
    return Run(RunSpec(**values), install_signal_handler=False)


def _train(run: Run, model=None, notice_at=None):
    torch.manual_seed(0)
    model = model or torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = run.dataloader(_data(), batch_size=8)
    model, optimizer = run.track(model, optimizer)
    while not run.done:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if notice_at is not None and run.step_count + 1 == notice_at:
                run.notice("test")
            run.step(loss=loss)
            if run.done:
                break
    run.finish(eval_loss=float(loss.detach()))
    return model


def test_telemetry_holds_steps_fast_decisions_checkpoints_and_the_end(tmp_path):
    run = _run(tmp_path)
    _train(run)
    kinds = [e["type"] for e in _events(tmp_path / "local")]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert kinds.count("step") == 12
    assert kinds.count("decision") == 2  # steps 4 and 8; step 12 is the end
    assert kinds.count("checkpoint") == 3  # steps 5, 10, and the final one at 12
    outcome = json.loads((tmp_path / "local" / "outcome-rank0.json").read_text())
    assert outcome["status"] == "completed" and outcome["step"] == 12
    records = read_consumption(consumption_path(tmp_path / "local" / "telemetry", "local"))
    batches = [r for r in records if r["type"] == "batch"]
    assert [r["step"] for r in batches] == list(range(12))
    first_epoch = [i for r in batches[:8] for i in r["ids"]]  # 64 examples, 8 per batch
    assert sorted(first_epoch) == list(range(64))


def test_in_process_notice_raises_preempted_and_the_resume_matches(tmp_path):
    whole = _train(_run(tmp_path, run_id="whole", run_dir=tmp_path / "whole"))
    with pytest.raises(Preempted) as left:
        _train(_run(tmp_path, run_id="cut", run_dir=tmp_path / "cut"), notice_at=7)
    assert left.value.code == 143 and "step 7" in str(left.value)
    again = _run(tmp_path, run_id="cut", run_dir=tmp_path / "cut")
    assert again.resumed and again.step_count == 7
    resumed = _train(again)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_with_another_model_is_refused_by_name(tmp_path):
    with pytest.raises(Preempted):
        _train(_run(tmp_path), notice_at=3)
    run = _run(tmp_path)
    run.dataloader(_data(), batch_size=8)
    bigger = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    with pytest.raises(ModelChangedError, match="architecture it was trained with"):
        run.track(bigger, torch.optim.SGD(bigger.parameters(), lr=0.1))


def test_resume_on_other_data_is_refused_by_name(tmp_path):
    with pytest.raises(Preempted):
        _train(_run(tmp_path), notice_at=3)
    run = _run(tmp_path)
    with pytest.raises(DataChangedError, match="trained on other data"):
        run.dataloader(_data(n=80), batch_size=8)


def test_state_that_weights_only_load_cannot_read_is_refused_before_training(tmp_path):
    run = _run(tmp_path)
    model = torch.nn.Linear(4, 1)
    with pytest.raises(StateNotSaveableError, match="extra"):
        run.track(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  extra={"tokenizer": object()})


def test_an_iterable_dataset_is_refused_with_the_reason(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(10)

    with pytest.raises(DataChangedError, match="map-style"):
        _run(tmp_path).dataloader(Stream(), batch_size=2)


def test_a_lever_the_framework_cannot_apply_is_refused_at_init(tmp_path):
    spec = RunSpec(run_id="hf", run_dir=tmp_path / "hf", fast_levers=("batch_scaling",
                                                                      "preemption"))
    with pytest.raises(RunSpecError, match="batch_scaling: trainer-x builds its own data loader"):
        Run(spec, capabilities=Capabilities(framework="trainer-x", batch_size=False),
            install_signal_handler=False)
    allowed = RunSpec(run_id="hf", run_dir=tmp_path / "hf", fast_levers=("preemption",))
    Run(allowed, capabilities=Capabilities(framework="trainer-x", batch_size=False),
        install_signal_handler=False)


def test_spec_file_with_an_unknown_field_names_it(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"format": "trainwise-run-spec/1", "run_id": "a",
                                "run_dir": str(tmp_path), "max_step": 5}))
    with pytest.raises(RunSpecError, match="max_step"):
        read_spec(path)


def test_sampler_order_resumes_exactly_mid_epoch():
    whole = list(ResumableBatchSampler(50, 8, seed=4))  # one epoch: 7 batches, the last of 2
    cut = ResumableBatchSampler(50, 8, seed=4)
    batches = iter(cut)
    taken = [next(batches) for _ in range(3)]
    again = ResumableBatchSampler(50, 8, seed=4)
    again.load_state_dict(cut.state_dict((cut.epoch, cut.cursor)))
    assert taken + list(again) == whole
    assert sorted(i for batch in whole for i in batch) == list(range(50))
    assert list(ResumableBatchSampler(50, 8, seed=5)) != whole  # the seed sets the order


# -- where the job runs --------------------------------------------------------------------------

def test_placement_on_a_machine_without_a_gpu(tmp_path):
    from trainwise.sdk import device

    if torch.cuda.is_available():
        pytest.skip("this test is about a machine without a GPU")
    run = _run(tmp_path)
    assert run.device.type == "cpu" and run.placement.precision == "fp32"
    with run.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    bf16 = device.choose("cpu", "bf16")
    with bf16.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert not bf16.grad_scaler().is_enabled()
    with pytest.raises(RunSpecError, match="sees no GPU here.*use device 'auto' or 'cpu'"):
        _run(tmp_path, device="cuda")
    with pytest.raises(RunSpecError, match="'fp16' needs a GPU"):
        _run(tmp_path, precision="fp16")
    try:
        assert device.choose(cpu_threads=2).cpu_threads == 2
    finally:
        torch.set_num_threads(1)


def test_to_device_keeps_the_shape_of_the_batch():
    from collections import namedtuple

    from trainwise.sdk import device

    Pair = namedtuple("Pair", "x y")
    placement = device.choose("cpu")
    batch = {"ids": torch.arange(3), "pair": Pair(torch.zeros(1), [torch.ones(1), "text"])}
    moved = placement.to_device(batch)
    assert isinstance(moved["pair"], Pair) and moved["pair"].y[1] == "text"
    assert torch.equal(moved["ids"], torch.arange(3))


# -- the launcher's preemption risk ----------------------------------------------------------------

def test_a_known_risk_makes_the_fast_layer_checkpoint_on_youngs_interval(tmp_path):
    """With the risk a launcher observed on the node's market (certain here: an MTBF of 0.6 s),
    a checkpoint older than Young's interval for it (the measured save cost) is written at the
    next fast tick, without a notice; with no risk (the default) none is (the telemetry test
    above counts only interval and final checkpoints)."""
    run = _run(tmp_path, preemption_risk=1.0, max_steps=12, checkpoint_every_steps=5,
               fast_every_steps=4)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = run.dataloader(_data(), batch_size=8)
    model, optimizer = run.track(model, optimizer)
    while not run.done:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(0.2)  # 0.6 s between the step-5 checkpoint and the step-8 tick
            run.step(loss=loss)
            if run.done:
                break
    run.finish()
    events = _events(tmp_path / "local")
    saved = [(e["step"], e["reason"]) for e in events if e["type"] == "checkpoint"]
    assert (8, "risk") in saved and (5, "interval") in saved and (10, "interval") in saved
    [tick] = [e for e in events if e["type"] == "decision" and e["step"] == 8]
    assert tick["action"]["preemption_response"] == "checkpoint_now"
    assert tick["numbers"]["preemption_risk"] == 1.0


def test_a_risk_that_is_not_a_probability_is_refused(tmp_path, monkeypatch):
    import trainwise

    monkeypatch.delenv("TRAINWISE_RUN_SPEC", raising=False)
    with pytest.raises(RunSpecError, match="preemption_risk 1.5 must be a probability"):
        trainwise.init(run_id="risky", run_dir=str(tmp_path / "risky"), preemption_risk=1.5)


def test_a_launchers_step_limit_caps_the_jobs_own_max_steps(tmp_path, monkeypatch):
    """A probe's spec caps the steps; the job's `init(max_steps=40)` cannot raise the cap, and a
    smaller max_steps of the job's own stays."""
    from trainwise.sdk.spec import resolve_spec

    path = write_spec(RunSpec(run_id="probe", run_dir=str(tmp_path / "probe"), max_steps=3,
                              step_limit=3), tmp_path / "probe.spec.json")
    monkeypatch.setenv("TRAINWISE_RUN_SPEC", str(path))
    assert resolve_spec(max_steps=40).max_steps == 3
    assert resolve_spec(max_steps=2).max_steps == 2
    assert resolve_spec().max_steps == 3
    monkeypatch.delenv("TRAINWISE_RUN_SPEC")
    with pytest.raises(RunSpecError, match="step_limit 0 must be >= 1"):
        resolve_spec(run_id="a", run_dir=str(tmp_path / "a"), step_limit=0)
