"""Per-worker step-time inflation sampled from real distributed training jobs.

Data: `cluster/stragglers/job_*_norm.csv` (alibaba/clusterdata, cluster-trace-gpu-v2020
mini-batch-time, CC BY 4.0; Xiao et al., "AntMan", OSDI'20): per iteration (`time`), the
mini-batch time of each of 10 workers (`batch_time_norm`, scaled 0-1000).

Inflation of a worker at an iteration = its batch time / the median batch time of all workers at
that iteration: 1.0 is a worker at the median speed (the reference throughput), 1.3 is a worker
30% slower. Only iterations where every worker reported are used (job 2 has a few partial rows,
where a median of one or two workers would say nothing).

In synchronous data-parallel training a step ends when the slowest rank ends, so a step of n
ranks takes max(inflation of its n ranks) times the reference step time. Ranks are drawn
independently from the pooled inflations (the files do not hold more than 10 workers per job).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def default_straggler_dir() -> Path:
    from trainwise import settings

    return settings.data_dir() / "cluster" / "stragglers"


def load_step_inflation(folder: str | Path | None = None) -> np.ndarray:
    """Pooled per-worker inflations (batch time / per-iteration median) of every job file."""
    folder = Path(folder) if folder is not None else default_straggler_dir()
    files = sorted(folder.glob("job_*_norm.csv"))
    if not files:
        raise FileNotFoundError(f"no job_*_norm.csv files in {folder}; check TRAINWISE_DATA_DIR")
    pooled: list[np.ndarray] = []
    for path in files:
        table = np.genfromtxt(path, delimiter=",", skip_header=1)
        if table.ndim != 2 or table.shape[1] != 5 or table.shape[0] == 0:
            raise ValueError(f"{path}: expected rows ',worker,gpu,time,batch_time_norm'")
        workers = table[:, 1].astype(np.int64)
        iteration = table[:, 3].astype(np.int64)
        batch_time = table[:, 4]
        if (batch_time <= 0).any() or np.isnan(batch_time).any():
            raise ValueError(f"{path}: batch_time_norm must be positive numbers")
        n_workers = len(np.unique(workers))
        order = np.argsort(iteration, kind="stable")
        iteration, batch_time = iteration[order], batch_time[order]
        _steps, first, counts = np.unique(iteration, return_index=True, return_counts=True)
        for start, count in zip(first[counts == n_workers], counts[counts == n_workers]):
            row = batch_time[start : start + count]
            pooled.append(row / np.median(row))
    return np.concatenate(pooled)


class StragglerSampler:
    """Resamples observed inflations (bootstrap), deterministic for a seed."""

    def __init__(self, inflation: np.ndarray, seed: int = 0):
        if inflation.size == 0:
            raise ValueError("inflation sample is empty")
        self.inflation = inflation
        self.rng = np.random.default_rng(seed)

    def sample_inflation(self, n: int) -> np.ndarray:
        """Inflation of n worker-steps."""
        return self.rng.choice(self.inflation, size=n)

    def sample_step_slowdown(self, n_ranks: int, n_steps: int) -> np.ndarray:
        """Slowdown of n_steps synchronous steps of n_ranks ranks: the slowest rank's inflation."""
        if n_ranks < 1 or n_steps < 1:
            raise ValueError(f"n_ranks={n_ranks} and n_steps={n_steps} must be at least 1")
        return self.rng.choice(self.inflation, size=(n_steps, n_ranks)).max(axis=1)

    def expected_step_slowdown(self, n_ranks: int, n_steps: int = 20000) -> float:
        """Mean slowdown of a synchronous step; a training tick holds thousands of steps, so the
        simulator applies this mean as a constant throughput factor."""
        return float(self.sample_step_slowdown(n_ranks, n_steps).mean())
