"""Node faults and repairs sampled from a real LLM pre-training cluster's fault log.

Data: `cluster/faults/infinitehbd-fault-trace.json` (stepfun-ai/InfiniteHBD-Trace, Apache-2.0):
584 fault_start/fault_end pairs on 231 of 400 nodes over 349 days; `event_time` is in days.
A fault is paired with the next fault_end of the same node and the same fault description (every
event pairs this way in the file; pairing by node alone would mix overlapping faults).

Two empirical distributions come out of it, both resampled as observed (no fitted family):
- cluster inter-arrival: gaps between consecutive fault starts anywhere in the 400-node cluster;
  a group of n nodes sees faults n/400 as often (independent nodes, superposition), so its gaps
  are the cluster's gaps scaled by 400/n;
- repair time: fault_end - fault_start of each pair (on a cloud, a faulty node is replaced instead;
  the repair time matters for owned clusters and the emulated provider).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SECONDS_PER_DAY = 86400.0
# The traced cluster size, from the data set's README (231 of 400 nodes ever faulted).
TRACED_CLUSTER_NODES = 400


@dataclass(frozen=True)
class FaultTrace:
    cluster_interarrival_s: np.ndarray
    repair_s: np.ndarray
    cluster_nodes: int
    span_s: float
    source_path: str

    @property
    def node_mtbf_s(self) -> float:
        """Mean time between faults of one node (cluster mean gap times the cluster size)."""
        return float(self.cluster_interarrival_s.mean()) * self.cluster_nodes


def default_fault_path() -> Path:
    from trainwise import settings

    return settings.data_dir() / "cluster" / "faults" / "infinitehbd-fault-trace.json"


def load_fault_trace(
    path: str | Path | None = None, cluster_nodes: int = TRACED_CLUSTER_NODES
) -> FaultTrace:
    """Pair fault starts and ends and return the empirical inter-arrival and repair times."""
    path = Path(path) if path is not None else default_fault_path()
    try:
        events = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"fault trace {path} does not exist; check TRAINWISE_DATA_DIR") from None
    if not isinstance(events, list) or not events:
        raise ValueError(f"fault trace {path} has no events (expected a non-empty JSON list)")
    open_faults: dict[tuple[str, str], float] = {}
    starts: list[float] = []
    repairs: list[float] = []
    for index, event in enumerate(events):
        try:
            key = (event["node_id"], event["fault_type"]["Desc"])
            time_days = float(event["event_time"])
            kind = event["event_type"]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"fault trace {path}: event {index} lacks node_id/event_time/"
                f"event_type/fault_type.Desc ({error})"
            ) from error
        if kind == "fault_start":
            if key in open_faults:
                raise ValueError(
                    f"fault trace {path}: event {index} starts a fault already open on {key}"
                )
            open_faults[key] = time_days
            starts.append(time_days)
        elif kind == "fault_end":
            if key not in open_faults:
                raise ValueError(
                    f"fault trace {path}: event {index} ends a fault never started on {key}"
                )
            repairs.append(time_days - open_faults.pop(key))
        else:
            raise ValueError(
                f"fault trace {path}: event {index} has event_type {kind!r}; "
                "valid: fault_start, fault_end"
            )
    if len(starts) < 2:
        raise ValueError(
            f"fault trace {path}: need at least 2 faults to measure inter-arrival times"
        )
    start_days = np.sort(np.asarray(starts))
    return FaultTrace(
        cluster_interarrival_s=np.diff(start_days) * SECONDS_PER_DAY,
        repair_s=np.asarray(repairs) * SECONDS_PER_DAY,
        cluster_nodes=cluster_nodes,
        span_s=float(start_days[-1] - start_days[0]) * SECONDS_PER_DAY,
        source_path=str(path),
    )


class FaultSampler:
    """Resamples the observed fault gaps and repair times (bootstrap), deterministic for a seed."""

    def __init__(self, trace: FaultTrace, seed: int = 0):
        self.trace = trace
        self.rng = np.random.default_rng(seed)

    def cluster_interarrival_s(self, n: int) -> np.ndarray:
        return self.rng.choice(self.trace.cluster_interarrival_s, size=n)

    def repair_s(self, n: int) -> np.ndarray:
        return self.rng.choice(self.trace.repair_s, size=n)

    def group_interarrival_s(self, n: int, nodes: int) -> np.ndarray:
        """Gaps between faults in a group of `nodes` nodes: cluster gaps times cluster/nodes."""
        if nodes < 1:
            raise ValueError(f"nodes={nodes} must be at least 1")
        return self.cluster_interarrival_s(n) * (self.trace.cluster_nodes / nodes)

    def fault_times_s(self, horizon_s: float, nodes: int) -> list[float]:
        """Fault instants in [0, horizon_s) for a group of `nodes` nodes held the whole time.

        A window starts at an arbitrary instant, so its first fault comes after the forward
        recurrence time: a gap picked with probability proportional to its length (a window
        rarely starts inside a short gap), times a uniform share. Then the observed gaps follow,
        zero gaps included (faults that struck several nodes at once).
        """
        if nodes < 1:
            raise ValueError(f"nodes={nodes} must be at least 1")
        gaps = self.trace.cluster_interarrival_s
        scale = self.trace.cluster_nodes / nodes
        covering = self.rng.choice(gaps, p=gaps / gaps.sum())
        now = float(covering) * scale * float(self.rng.random())
        times: list[float] = []
        while now < horizon_s:
            times.append(now)
            now += float(self.group_interarrival_s(1, nodes)[0])
        return times
