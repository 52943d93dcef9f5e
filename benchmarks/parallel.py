"""Run a benchmark's independent runs in worker processes, logging each result as it lands."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any


def run_in_workers(runs: Sequence[Any], run_one: Callable[[Any], dict[str, Any]], jobs: int,
                   progress_line: Callable[[dict[str, Any], int, int], str],
                   log: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """`run_one` over `runs` with `jobs` processes (1 = in this process); results in completion
    order. Workers are spawned, not forked, so each builds its own torch state (one thread)."""
    results: list[dict[str, Any]] = []
    if jobs <= 1:
        for run in runs:
            results.append(run_one(run))
            log(progress_line(results[-1], len(results), len(runs)))
        return results
    import concurrent.futures
    import multiprocessing

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(run_one, run) for run in runs]
        for future in concurrent.futures.as_completed(futures):
            results.append(future.result())
            log(progress_line(results[-1], len(results), len(runs)))
    return results
