"""Straggler re-balancing under torchrun: 2 ranks, one slowed 1.5x by replayed trace delays.

    .venv/bin/python -m benchmarks.stragglers_ddp [--steps 40] [--repeats 1] [--fast-every 1]

Three jobs of `training.ddp_worker` (gloo, CPU, one thread per rank, a tiny GPT on synthetic
tokens: timing only, what is learned does not matter):
  baseline   no straggler, even shares
  straggler  rank 1 slowed, even shares (the fast layer off: NoOp policy)
  rebalanced rank 1 slowed, shares from controllers.stragglers every `fast_every` steps

Slowdown replay: ../shared/data/cluster/stragglers/job_2_norm.csv (Alibaba PAI, AntMan OSDI'20):
the slowest worker's mini-batch time over the median worker's, per iteration, r_t. Its excess is
scaled so the mean slowdown is 1.5x: f_t = 1 + (r_t - 1) * 0.5 / mean(r - 1), so the trace's
step-to-step fluctuation is kept (clipped at >= 1). Rank 1's compute is stretched by f_t at step t
(a sleep of (f_t - 1) x its measured compute time: a slower device, proportional to its work).
Device time is emulated: each micro batch sleeps MICRO_BATCH_MS on top of its real forward and
backward, since on CPU cores shared with other jobs real compute time measures the neighbours.
The collectives (gloo all-gather, gradient all-reduce), the sampler, the shares and the fast
layer are the real ones.

Figures (medians of the repeats; the recovered share is computed within each repeat, whose three
jobs run back to back, then the median taken): time to a fixed number of samples (the sum of
rank 0's step times: every rank waits for the slowest, so rank 0's step time is the gang's) and
mean step time. Recovered share of lost
throughput = (T_straggler - T_rebalanced) / (T_straggler - T_baseline). A slowed rank's own lost
capacity cannot be recovered by moving work: were the whole step slowed, speeds 1 and 1/1.5 would
give at best T_baseline x 2 / (1 + 1/1.5) = 1.2 T_baseline, a ceiling of 60 % for that share
(a little higher here: the sampler, all-reduce and optimizer step are not slowed), and less for
shares in whole micro batches under a factor that changes every step: an oracle that knows each
step's factor and splits the 32 micro batches best recovers 57 % (`oracle_recovered_share`,
computed from the trace and the baseline's step time). The issue's 70 % goal is therefore out of
reach by moving work alone; `share_of_recoverable_recovered` relates the result to that oracle.

The fast layer ticks every step by default (`--fast-every 1`): a decision costs ~0.01 % of a
step, and the trace's factor changes from step to step (lag-1 autocorrelation 0.57), so a
fresher share pays (simulated on the trace: 49 % recovered at every step, 44 % every 2nd).
Smoothing and hysteresis stay at the controller's defaults (EMA 0.9, min gain 5 %): lower
values gain < 1 % of step time on the Alibaba traces and re-balance at 10-60 % of the steps
instead of < 4 % (tests/test_controllers_stragglers.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.results_io import write_results
from telemetry.reader import read_run_events
from training.data_types import ExampleSet

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "cluster" / "stragglers" / "job_2_norm.csv"
SLOWDOWN = 1.5
# Emulated device time per micro batch, slept on top of the real forward/backward (~2 ms): the
# 2 CPU cores of the dev box are shared with other jobs, so real compute time measures them.
MICRO_BATCH_MS = 20.0
# Elastic trial: checkpoints every 5 steps, rank 1 killed after step 12 (2 steps past one).
ELASTIC_CHECKPOINT_EVERY = 5
ELASTIC_KILL_AFTER_STEP = 12
VOCAB = tuple("abcdefghijklmnop")


def synthetic_examples(n: int = 4096, block: int = 16) -> ExampleSet:
    """Random token windows (timing only)."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, len(VOCAB), (n, block + 1))
    is_eval = np.zeros(n, dtype=bool)
    is_eval[::16] = True
    return ExampleSet(
        partition="synthetic", kind="text", example_ids=np.arange(n, dtype=np.int64),
        is_eval=is_eval, inputs=inputs.astype(np.int64), labels=None, vocab=VOCAB,
        shard_index=np.zeros(n, dtype=np.int32), fingerprint="s" * 64,
    )


def replayed_factors(trace: Path = TRACE, mean_slowdown: float = SLOWDOWN) -> list[float]:
    """Per-step slowdown factors of the trace's slowest worker, scaled to `mean_slowdown`."""
    rows = np.genfromtxt(trace, delimiter=",", skip_header=1, usecols=(1, 3, 4))
    workers = sorted({int(w) for w in rows[:, 0]})
    times = sorted({int(t) for t in rows[:, 1]})
    table = np.full((len(times), len(workers)), np.nan)
    index = {t: i for i, t in enumerate(times)}
    for worker, when, value in rows:
        table[index[int(when)], workers.index(int(worker))] = value
    table = table[~np.isnan(table).any(axis=1)]  # iterations every worker reported
    slowest = int(np.argmax(table.mean(axis=0)))
    ratio = table[:, slowest] / np.median(table, axis=1)
    excess = ratio - 1.0
    factors = 1.0 + excess * (mean_slowdown - 1.0) / excess.mean()
    return [float(f) for f in np.maximum(factors, 1.0)]


def oracle_recovered_share(factors: list[float], steps: int, base_step_ms: float,
                           micro_batches: int) -> float:
    """Recovered share of an oracle that knows step t's factor f_t and gives the slowed rank
    the best whole number n of the micro batches: step = max((M - n) c, n c f_t), with c the
    baseline's time per micro batch (its step / (M / 2)); the fixed part of a step cancels."""
    c = base_step_ms / (micro_batches / 2)
    half = micro_batches // 2
    slow = best = 0.0
    for step in range(steps):
        f = factors[step % len(factors)]
        slow += max(half * c, half * c * f)
        best += min(max((micro_batches - n) * c, n * c * f) for n in range(1, micro_batches))
    lost = slow - steps * half * c
    return (slow - best) / lost if lost > 0 else float("nan")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_config(name: str, *, steps: int, fast_every: int, **changes: Any) -> dict[str, Any]:
    """TrainConfig fields of the benchmark's jobs (a tiny GPT, 32 micro batches of 2)."""
    return {
        "max_steps": steps, "micro_batch_size": 2, "grad_accum_steps": 32,
        "learning_rate": 1e-3, "min_learning_rate": 1e-4, "warmup_steps": 2,
        "eval_every_steps": 10_000, "eval_batches": 1, "eval_batch_size": 8,
        "checkpoint_every_steps": 0, "fast_every_steps": fast_every, "seed": 1,
        "run_id": name,
        "model": {"kind": "gpt", "vocab_size": len(VOCAB), "block_size": 16, "n_layer": 1,
                  "n_head": 2, "n_embd": 16},
        **changes,
    }


def run_job(work: Path, name: str, *, steps: int, policy: dict[str, Any],
            factors: list[float] | None, fast_every: int) -> dict[str, Any]:
    """One torchrun job; returns its per-step figures from telemetry."""
    config = job_config(name, steps=steps, fast_every=fast_every)
    spec = {"examples": "benchmarks.stragglers_ddp:synthetic_examples", "config": config,
            "out_dir": str(work / name), "policy": policy, "micro_batch_ms": MICRO_BATCH_MS,
            "result_dir": str(work / f"{name}-results")}
    if factors is not None:
        spec["slowdown"] = {"rank": 1, "factors": factors}
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
         "-m", "training.ddp_worker", str(spec_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"job {name} failed:\n{done.stderr[-3000:]}")
    events = read_run_events(work / name / "telemetry" / name)
    steps0 = [e for e in events if e["type"] == "step" and e["rank"] == 0]
    steps1 = [e for e in events if e["type"] == "step" and e["rank"] == 1]
    decisions = [e for e in events if e["type"] == "decision"]
    step_ms = [e["step_time_ms"] for e in steps0]
    decision_ms = [d["numbers"].get("decision_ms", 0.0) for d in decisions]
    return {
        "time_to_samples_s": sum(step_ms) / 1000.0,
        "samples": steps0[-1]["samples_seen"],
        "mean_step_ms": statistics.fmean(step_ms),
        "mean_step_ms_second_half": statistics.fmean(step_ms[len(step_ms) // 2 :]),
        "rank1_final_share": steps1[-1]["share"],
        "rank0_mean_wait_ms": statistics.fmean(e["allreduce_wait_ms"] for e in steps0),
        "rank1_mean_wait_ms": statistics.fmean(e["allreduce_wait_ms"] for e in steps1),
        "decisions": len(decisions),
        "mean_decision_ms": statistics.fmean(decision_ms) if decision_ms else 0.0,
        # The fast layer's cost per step: one decision every fast_every steps.
        "decision_share_of_step": (sum(decision_ms) / sum(step_ms)) if step_ms else 0.0,
    }


def elastic_spec(work: Path, *, config: dict[str, Any], examples: str,
                 micro_batch_ms: float) -> Path:
    """The spec of a job that resumes from its own last checkpoint when (re)started."""
    spec = {"examples": examples, "config": config, "out_dir": str(work / "run"),
            "policy": {"kind": "noop"}, "resume_from": "auto",
            "result_dir": str(work / "results"), "micro_batch_ms": micro_batch_ms}
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _reached(rank_dir: Path, run_id: str, rank: int, step: int) -> bool:
    needle = f'"type":"step","schema_version":1,"run_id":"{run_id}","rank":{rank},"step":{step},'
    return rank_dir.is_dir() and any(needle in p.read_text()
                                     for p in rank_dir.glob("segment-*.jsonl"))


def _start_elastic(spec_path: Path, env: dict[str, str], log_file: Any) -> subprocess.Popen:
    # stderr to a file: workers that outlive a killed agent would hold a pipe open.
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", "--nproc_per_node=2",
         "--max-restarts=1", "--monitor-interval=0.1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "-m", "training.ddp_worker",
         str(spec_path)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log_file,
    )


def elastic_trial(work: Path, *, config: dict[str, Any], examples: str, kill_rank: int,
                  kill_after_step: int, micro_batch_ms: float,
                  timeout_s: float = 300.0) -> dict[str, Any]:
    """Elastic membership: `torchrun --nnodes=1:1 --max-restarts=1` (c10d rendezvous); once
    `kill_rank` has written step `kill_after_step`, SIGKILL to it (no notice, no checkpoint).
    Torch elastic restarts the gang, which resumes from the last checkpoint. Lost work per
    failure: the steps trained again (the restarted run_start's replay_from..replay_to), the
    seconds billed for them (`lost_s`) and the downtime from the kill to the restarted gang's
    first new step."""
    spec_path = elastic_spec(work, config=config, examples=examples,
                             micro_batch_ms=micro_batch_ms)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log = work / "torchrun.log"
    began = time.time()
    with log.open("w") as log_file:
        process = _start_elastic(spec_path, env, log_file)
    run_id = config["run_id"]

    telemetry = work / "run" / "telemetry" / run_id
    killed_at = None
    try:
        while process.poll() is None and time.time() - began < timeout_s:
            if _reached(telemetry / f"rank{kill_rank}", run_id, kill_rank, kill_after_step):
                pid = int((work / "results" / f"rank{kill_rank}.pid").read_text())
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
                break
            time.sleep(0.02)
        process.wait(timeout=max(1.0, timeout_s - (time.time() - began)))
    except subprocess.TimeoutExpired:
        process.kill()
        for pid_file in (work / "results").glob("rank*.pid"):  # workers outlive their agent
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        process.wait(timeout=30)
    stderr = log.read_text(errors="replace")
    if killed_at is None:
        raise RuntimeError(f"rank {kill_rank} never reached step {kill_after_step}; torchrun "
                           f"said:\n{stderr[-3000:]}")
    results = []
    for rank in range(2):
        path = work / "results" / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"error": "none"})
    events = read_run_events(telemetry, rank=0)
    starts = [i for i, e in enumerate(events) if e["type"] == "run_start"]
    restart = events[starts[-1]]
    after = [e for e in events[starts[-1]:] if e["type"] == "step"]  # the restarted gang's
    replayed = ((restart["replay_to_step"] or 0) - (restart["replay_from_step"] or 0)
                if restart.get("replay_to_step") is not None else 0)
    return {
        "returncode": process.returncode, "stderr_tail": stderr[-3000:], "results": results,
        "restarts": len(starts) - 1, "resumed_from": restart.get("resumed_from"),
        "replay_from_step": restart.get("replay_from_step"),
        "replay_to_step": restart.get("replay_to_step"), "replayed_steps": replayed,
        "lost_s": restart.get("lost_s"),
        "downtime_s": (after[0]["wall_time_s"] - killed_at) if after else None,
        "wall_s": time.time() - began,
        "final_steps": [r.get("steps") for r in results],
        "status": [r.get("status") for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--fast-every", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--elastic-kills", type=int, default=1,
                        help="elastic trials (a worker SIGKILLed, the gang restarted); 0: none")
    args = parser.parse_args(argv)
    factors = replayed_factors()
    jobs = {
        "baseline": ({"kind": "noop"}, None),
        "straggler": ({"kind": "noop"}, factors),
        "rebalanced": ({"kind": "stragglers"}, factors),
    }
    figures: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    with tempfile.TemporaryDirectory(prefix="stragglers-ddp-") as tmp:
        for repeat in range(args.repeats):
            for name, (policy, slow) in jobs.items():
                figures[name].append(run_job(Path(tmp), f"{name}-{repeat}", steps=args.steps,
                                             policy=policy, factors=slow,
                                             fast_every=args.fast_every))
                print(name, repeat, json.dumps(figures[name][-1]), flush=True)
        elastic = []
        for trial in range(args.elastic_kills):
            work = Path(tmp) / f"elastic-{trial}"
            work.mkdir()
            config = job_config(f"elastic-{trial}", steps=args.steps, fast_every=args.fast_every,
                                checkpoint_every_steps=ELASTIC_CHECKPOINT_EVERY)
            elastic.append(elastic_trial(
                work, config=config, examples="benchmarks.stragglers_ddp:synthetic_examples",
                kill_rank=1, kill_after_step=ELASTIC_KILL_AFTER_STEP,
                micro_batch_ms=MICRO_BATCH_MS))
            print("elastic", trial, json.dumps({k: v for k, v in elastic[-1].items()
                                                if k != "stderr_tail"}), flush=True)
    median = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
              for name, runs in figures.items()}
    # The three jobs of a repeat run back to back and are compared with each other (paired):
    # the load other jobs put on the machine drifts between repeats.
    shares = []
    for repeat in range(args.repeats):
        base, slow, fix = (figures[name][repeat]["time_to_samples_s"] for name in jobs)
        shares.append((slow - fix) / (slow - base) if slow > base else float("nan"))
    t_base = median["baseline"]["time_to_samples_s"]
    t_slow = median["straggler"]["time_to_samples_s"]
    t_ideal = t_base * 2.0 / (1.0 + 1.0 / SLOWDOWN)
    lost = t_slow - t_base
    recovered = statistics.median(shares)
    oracle = oracle_recovered_share(factors, args.steps,
                                    median["baseline"]["mean_step_ms"], micro_batches=32)
    summary = {
        "recovered_share_of_lost_throughput": recovered,  # median of the paired repeats
        "recovered_share_per_repeat": shares,
        "ideal_if_whole_step_slowed_s": t_ideal,
        "ceiling_if_whole_step_slowed": (t_slow - t_ideal) / lost if lost > 0 else float("nan"),
        "goal": ">= 0.70 of the lost throughput (issue 11)",
        "goal_met": bool(recovered >= 0.70),
        "oracle_recovered_share": oracle,
        "share_of_recoverable_recovered": recovered / oracle if oracle > 0 else float("nan"),
        "fast_layer_share_of_step_time": median["rebalanced"]["decision_share_of_step"],
    }
    payload = {"config": {**vars(args), "trace": str(TRACE.relative_to(REPO.parent)),
                          "mean_slowdown": SLOWDOWN,
                          "micro_batch_ms": MICRO_BATCH_MS, "replayed_steps": len(factors),
                          "ranks": 2, "backend": "gloo", "threads_per_rank": 1},
               "median": median, "runs": figures, "summary": summary,
               "elastic": [{k: v for k, v in e.items() if k != "stderr_tail"} for e in elastic]}
    lines = [
        "# Straggler re-balancing under torchrun (2 ranks, rank 1 slowed 1.5x from the trace)",
        "",
        f"Replayed: `{TRACE.name}` slowest worker over the median, scaled to a mean of "
        f"{SLOWDOWN}x; {args.steps} steps of 32 micro batches x 2 examples, each "
        f"{MICRO_BATCH_MS:.0f} ms of emulated device time plus its real forward/backward; gloo "
        f"on CPU, one thread per rank; median of {args.repeats} run(s).",
        "",
        "| job | time to samples (s) | mean step (ms) | 2nd-half step (ms) | rank 1 share | "
        "rank 0 wait (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in median.items():
        lines.append(
            f"| {name} | {row['time_to_samples_s']:.2f} | {row['mean_step_ms']:.1f} | "
            f"{row['mean_step_ms_second_half']:.1f} | {row['rank1_final_share']:.3f} | "
            f"{row['rank0_mean_wait_ms']:.1f} |"
        )
    lines += [
        "",
        f"- Recovered share of lost throughput: **{recovered:.0%}** (median of the repeats, each "
        f"against its own baseline: {', '.join(f'{x:.0%}' for x in shares)}; goal >= 70 %: "
        f"{'met' if summary['goal_met'] else 'NOT met'}). Moving work cannot give back the slow "
        f"rank's own lost capacity: were the whole step slowed 1.5x, the best possible would be "
        f"{t_ideal:.2f} s, a ceiling of {summary['ceiling_if_whole_step_slowed']:.0%} for this "
        "share (a little higher here: the sampler, all-reduce and optimizer are not slowed).",
        f"- An oracle that knows every step's slowdown and splits the 32 micro batches best "
        f"would recover {oracle:.0%}: the result is {summary['share_of_recoverable_recovered']:.0%}"
        " of what moving work can recover; the 70 % goal is out of reach this way.",
        f"- Fast layer (rank 0's decision) share of step time at 2 ranks: "
        f"{summary['fast_layer_share_of_step_time']:.4%}.",
    ]
    for e in elastic:
        downtime = "n/a" if e["downtime_s"] is None else f"{e['downtime_s']:.1f} s"
        lines.append(
            f"- Elastic (`torchrun --nnodes=1:1 --max-restarts=1`, rank 1 SIGKILLed after step "
            f"{ELASTIC_KILL_AFTER_STEP}, checkpoints every {ELASTIC_CHECKPOINT_EVERY}): "
            f"{e['restarts']} restart, resumed from `{Path(e['resumed_from'] or '-').name}`, "
            f"finished {e['status']} at steps {e['final_steps']}; lost work per failure: "
            f"{e['replayed_steps']} step(s) trained again ({e['lost_s'] or 0:.1f} s billed), "
            f"downtime from the kill to the next new step {downtime}.")
    write_results(args.out, "stragglers_ddp", payload, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
