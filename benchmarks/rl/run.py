"""Learned policies, measured honestly.

1. Fast path: p50/p99 microseconds of `rl.fast_path.NumpyPolicy.predict` (one observation) next to
   stable-baselines3's `predict` on the same actor, and of a whole `LearnedFastPolicy.act`
   (heuristic + features + network).
2. Environments: steps per second of SlowEnv (heuristic choice) and FastEnv.
3. Slow layer out of sample (`rl.cells.make_split`): train on the first half of the 2023-02
   collection (all regions), evaluate on its later windows and on the two other collections,
   never seen in training: learned vs trainwise_heuristic vs uniform_progress vs the hindsight
   oracle (cost / oracle cost per cell, mean with a 95 % bootstrap interval over cells), deadline
   misses, and the promotion gate's decision (candidate vs heuristic).
4. Fast layer: the same for FastEnv on held-out seeds (seconds per 100 ideal steps).

    python -m benchmarks.rl --latency-only        (latency alone, ~1 min: rl_latency.*)
    nice -n 10 python -m benchmarks.rl [--slow-timesteps 20000] [--fast-timesteps 20000]
                                       [--held-out 40] [--out benchmarks/results]

Writes rl_eval.json / rl_eval.md via benchmarks.results_io (command, commit, tree state, machine).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.results_io import write_results
from cloud.oracle import hindsight_optimum
from cloud.policies import UniformProgressPolicy
from controllers.fast_heuristic import HeuristicFastPolicy
from rl.cells import heuristic_for, make_split
from rl.envs import FastEnv, SlowEnv
from rl.fast_obs import FAST_OBS_LAYOUT
from rl.fast_path import LearnedAllocationPolicy, LearnedFastPolicy, NumpyPolicy
from rl.gate import decide, evaluate_fast, evaluate_slow
from rl.policy_file import weights_from_sb3
from rl.slow_obs import SLOW_OBS_LAYOUT
from rl.train import train_policy

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def _percentiles_us(fn, calls: int) -> dict:
    times = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter_ns()
        fn()
        times[i] = time.perf_counter_ns() - start
    times = times[calls // 10:] / 1000.0  # drop warm-up
    return {"p50_us": float(np.percentile(times, 50)), "p99_us": float(np.percentile(times, 99)),
            "calls": int(len(times))}


def latency(model, calls: int) -> dict:
    net = NumpyPolicy(weights_from_sb3(model, "fast", FAST_OBS_LAYOUT, None))
    env = FastEnv(episode_ticks=50)
    obs_vec, _ = env.reset(seed=1)
    obs = env._observation()
    learned = LearnedFastPolicy(net, HeuristicFastPolicy())
    return {
        "numpy_predict": _percentiles_us(lambda: net.predict(obs_vec), calls),
        "sb3_predict": _percentiles_us(lambda: model.predict(obs_vec, deterministic=True),
                                       max(200, calls // 20)),
        "learned_fast_act": _percentiles_us(lambda: learned.act(obs), max(1000, calls // 5)),
        "heuristic_fast_act": _percentiles_us(lambda: HeuristicFastPolicy().act(obs),
                                              max(1000, calls // 5)),
    }


def env_speed(cells) -> dict:
    out = {}
    for name, env, action in (("slow_env", SlowEnv(cells[:1]), [0, 0]),
                              ("fast_env", FastEnv(), [0, 0, 0])):
        env.reset(seed=0)
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < 2.0:
            _, _, term, trunc, _ = env.step(np.asarray(action))
            steps += 1
            if term or trunc:
                env.reset()
        out[name] = steps / (time.perf_counter() - start)
        env.close()
    return out


def _ci(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (2000, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def slow_out_of_sample(timesteps: int, held_out: int, seed: int) -> dict:
    split = make_split(region=None, windows_per_zone=12)
    start = time.perf_counter()
    model, report = train_policy(lambda: SlowEnv(split.train), timesteps, n_envs=4, seed=seed,
                                 bc_states=3000)
    train_s = time.perf_counter() - start
    net = NumpyPolicy(weights_from_sb3(model, "slow", SLOW_OBS_LAYOUT, None, split.train_window))
    cells = list(split.held_out)
    if held_out and held_out < len(cells):
        cells = [cells[i] for i in np.linspace(0, len(cells) - 1, held_out).round().astype(int)]
    policies = {
        "trainwise_learned": lambda c: LearnedAllocationPolicy(net, heuristic_for(c)),
        "trainwise_heuristic": heuristic_for,
        "uniform_progress": lambda c: UniformProgressPolicy(),
    }
    rows = {name: evaluate_slow(make, cells) for name, make in policies.items()}
    oracle = np.array([hindsight_optimum(c.job, c.rules, c.market).cost_deadline_met_usd
                       for c in cells])
    summary = {}
    for name, r in rows.items():
        ratio = np.array([x["cost"] for x in r]) / oracle
        summary[name] = {"mean_cost_over_oracle": float(ratio.mean()), "ci95": _ci(ratio),
                         "misses": int(sum(x["missed"] for x in r)),
                         "mean_cost_usd": float(np.mean([x["cost"] for x in r]))}
    gate = decide(rows["trainwise_learned"], rows["trainwise_heuristic"])
    by_kind = {}
    for kind in ("single_zone", "multi_zone"):
        idx = [i for i, c in enumerate(cells) if c.kind == kind]
        if idx:
            by_kind[kind] = {name: float(np.mean([rows[name][i]["cost"] / oracle[i] for i in idx]))
                             for name in rows}
            by_kind[kind]["cells"] = len(idx)
    return {"train_cells": len(split.train), "held_out_cells": len(cells),
            "train_window": split.train_window, "ppo_timesteps": timesteps,
            "train_seconds": train_s, "bc_agreement": report.bc_agreement,
            "summary": summary, "by_kind": by_kind, "gate": gate.to_dict(),
            "learning_curve_tail": report.episode_returns[-20:]}


def fast_out_of_sample(timesteps: int, seeds: int, seed: int) -> tuple[dict, object]:
    start = time.perf_counter()
    model, report = train_policy(lambda: FastEnv(), timesteps, n_envs=4, seed=seed, bc_states=3000)
    train_s = time.perf_counter() - start
    net = NumpyPolicy(weights_from_sb3(model, "fast", FAST_OBS_LAYOUT, None))
    held = [20_000 + i for i in range(seeds)]
    cand = evaluate_fast(lambda: (lambda o: np.asarray(net.predict(o))), held)
    heur = evaluate_fast(lambda: (lambda o: np.zeros(3, np.int64)), held)
    gate = decide(cand, heur, unit="s per 100 ideal steps")
    gate_dict = gate.to_dict()
    gate_dict.pop("per_cell")
    return {"ppo_timesteps": timesteps, "train_seconds": train_s, "bc_agreement": report.bc_agreement,
            "held_out_seeds": seeds, "gate": gate_dict}, model


def markdown(payload: dict) -> str:
    lat, slow, fast = payload["latency"], payload["slow"], payload["fast"]
    lines = ["# Learned policies (issue 14)", "",
             "## Fast path latency (one decision, this machine)", "",
             "| call | p50 us | p99 us |", "|---|---|---|"]
    lines += [f"| {k} | {v['p50_us']:.1f} | {v['p99_us']:.1f} |" for k, v in lat.items()]
    lines += ["", f"Environment speed: SlowEnv {payload['env_steps_per_s']['slow_env']:.0f} steps/s, "
              f"FastEnv {payload['env_steps_per_s']['fast_env']:.0f} steps/s.", "",
              "## Slow layer, out of sample", "",
              f"Trained on {slow['train_cells']} cells ({slow['train_window']}), "
              f"{slow['ppo_timesteps']} PPO steps after the behaviour clone "
              f"({slow['train_seconds']:.0f} s); evaluated on {slow['held_out_cells']} held-out "
              "cells (later windows + two collections never seen).", "",
              "| policy | cost / oracle (mean) | 95% CI | deadline misses |", "|---|---|---|---|"]
    for name, s in slow["summary"].items():
        lines.append(f"| {name} | {s['mean_cost_over_oracle']:.4f} | "
                     f"{s['ci95'][0]:.4f}-{s['ci95'][1]:.4f} | {s['misses']} |")
    for kind, row in slow["by_kind"].items():
        lines.append(f"\n{kind} ({row['cells']} cells): " + ", ".join(
            f"{k} {v:.4f}" for k, v in row.items() if k != "cells"))
    g = slow["gate"]
    lines += ["", f"Gate (learned vs heuristic, margin {g['margin']:.0%}): **{g['reason']}** "
              f"(ratio {g['cost_ratio']:.4f}, CI {g['cost_ratio_ci95'][0]:.4f}-"
              f"{g['cost_ratio_ci95'][1]:.4f}).", "", "## Fast layer, held-out seeds", ""]
    g = fast["gate"]
    lines += [f"{fast['ppo_timesteps']} PPO steps ({fast['train_seconds']:.0f} s); gate on "
              f"{fast['held_out_seeds']} seeds: **{g['reason']}** (ratio {g['cost_ratio']:.4f}, CI "
              f"{g['cost_ratio_ci95'][0]:.4f}-{g['cost_ratio_ci95'][1]:.4f}, unit {g['unit']}).",
              "", "FastEnv's gradient-noise dynamics are a stated model (see rl/fast_env.py), not data."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rl")
    parser.add_argument("--slow-timesteps", type=int, default=20_000)
    parser.add_argument("--fast-timesteps", type=int, default=20_000)
    parser.add_argument("--held-out", type=int, default=40, help="held-out cells (0 = all)")
    parser.add_argument("--fast-seeds", type=int, default=30)
    parser.add_argument("--latency-calls", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--latency-only", action="store_true",
                        help="only the fast-path latency (behaviour-cloned actor): rl_latency.*")
    args = parser.parse_args(argv)
    if args.latency_only:
        model, _ = train_policy(lambda: FastEnv(episode_ticks=32), 0, n_envs=1, bc_states=256)
        payload = {"latency": latency(model, args.latency_calls)}
        text = "\n".join(["# Fast path latency (one decision, this machine)", "",
                          "| call | p50 us | p99 us |", "|---|---|---|"]
                         + [f"| {k} | {v['p50_us']:.1f} | {v['p99_us']:.1f} |"
                            for k, v in payload["latency"].items()])
        _, md_path = write_results(args.out, "rl_latency", payload, text)
        print(md_path.read_text())
        return payload
    fast, fast_model = fast_out_of_sample(args.fast_timesteps, args.fast_seeds, args.seed)
    payload = {
        "latency": latency(fast_model, args.latency_calls),
        "env_steps_per_s": env_speed(make_split(region=None, windows_per_zone=12).train),
        "slow": slow_out_of_sample(args.slow_timesteps, args.held_out, args.seed),
        "fast": fast,
    }
    json_path, md_path = write_results(args.out, "rl_eval", payload, markdown(payload))
    print(md_path.read_text())
    return payload
