"""Cost forecast of the next run: Monte Carlo over the real spot traces, one row per policy.

The uncertainty of a run's cost is when it starts: the spot market it meets. So a forecast
replays the job (`cloud/simulator.py`, the same rules as the cost suite) from `samples` start
ticks drawn uniformly from the trace, for the current allocation policy and each alternative,
and reports per policy the P50/P90 spend, the mean, and the deadline risk (share of starts
that miss the deadline and pay the on-demand completion charge), and the P50/P90 completion
time (a start that misses finishes on on-demand after the deadline: `completion_s`). The market
may be narrowed to a region's zones (`load_market(..., region=)`): a registered job's own
forecast (`trainwise/job_forecast.py`) replays its region.

Pruning shortens the work: a schedule that prunes `pruning_rate` of the prunable share of the
data trains on `1 - rate * PRUNABLE_SHARE` of the examples, so its work scales by that factor
(`work_for_rate`). The prunable share is the share of examples below the mean difficulty
(InfoBatch prunes only those); half is the value of a symmetric score distribution, used when
no scores are given.

Without the trace folder (no ../shared/data) the forecast runs on an embedded market: a
seeded two-state availability chain with the heuristic's prior (2 h up, 1 h down), labelled as
such in every result, so the asset still materializes on a bare machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cloud import prices
from cloud.policy_registry import make_policy
from cloud.simulator import (
    ClusterRules,
    JobSpec,
    Market,
    SimResult,
    market_from_traces,
    simulate,
)

PRUNABLE_SHARE = 0.5
EMBEDDED_TICK_S = 600
EMBEDDED_DAYS = 30
EMBEDDED_MEAN_UP_S = 2 * 3600.0
EMBEDDED_MEAN_DOWN_S = 3600.0
DEFAULT_INSTANCE = "p3.2xlarge"


@dataclass(frozen=True)
class MarketSource:
    market: Market
    source: str  # where the availability came from (trace folder or "embedded ...")
    embedded: bool


@dataclass
class PolicyForecast:
    policy: str
    work_gpu_h: float
    costs_usd: list[float] = field(repr=False)
    deadline_missed: int = 0
    # Completion time of each sampled start (s after the start): the finish inside the deadline,
    # else the deadline, one changeover and the remaining work on on-demand nodes.
    finish_s: list[float] = field(default_factory=list, repr=False)

    @property
    def p50_usd(self) -> float:
        return float(np.percentile(self.costs_usd, 50))

    @property
    def p90_usd(self) -> float:
        return float(np.percentile(self.costs_usd, 90))

    @property
    def mean_usd(self) -> float:
        return float(np.mean(self.costs_usd))

    @property
    def deadline_risk(self) -> float:
        return self.deadline_missed / len(self.costs_usd)

    @property
    def p50_h(self) -> float:
        return float(np.percentile(self.finish_s, 50)) / 3600.0 if self.finish_s else float("nan")

    @property
    def p90_h(self) -> float:
        return float(np.percentile(self.finish_s, 90)) / 3600.0 if self.finish_s else float("nan")

    def row(self) -> dict:
        row = {"policy": self.policy, "work_gpu_h": round(self.work_gpu_h, 3),
               "p50_usd": round(self.p50_usd, 2), "p90_usd": round(self.p90_usd, 2),
               "mean_usd": round(self.mean_usd, 2), "deadline_risk": round(self.deadline_risk, 4),
               "samples": len(self.costs_usd)}
        if self.finish_s:
            row.update(p50_h=round(self.p50_h, 3), p90_h=round(self.p90_h, 3))
        return row


def work_for_rate(base_work_gpu_h: float, pruning_rate: float,
                  prunable_share: float = PRUNABLE_SHARE) -> float:
    """GPU-hours left after pruning `pruning_rate` of the prunable share of the data."""
    if not 0.0 <= pruning_rate < 1.0:
        raise ValueError(f"pruning_rate={pruning_rate} must be in [0, 1)")
    return base_work_gpu_h * (1.0 - pruning_rate * prunable_share)


def embedded_market(seed: int = 0) -> Market:
    """A two-zone synthetic market (documented in the module docstring), Can't Be Late prices."""
    rng = np.random.default_rng(seed)
    ticks = EMBEDDED_DAYS * 86400 // EMBEDDED_TICK_S
    p_down = EMBEDDED_TICK_S / EMBEDDED_MEAN_UP_S  # chance an up tick ends
    p_up = EMBEDDED_TICK_S / EMBEDDED_MEAN_DOWN_S
    zones = []
    for _ in range(2):
        up, values = True, np.empty(ticks, dtype=np.int64)
        for i in range(ticks):
            values[i] = int(up)
            up = (rng.random() >= p_down) if up else (rng.random() < p_up)
        zones.append(values)
    return Market(("embedded-a", "embedded-b"), EMBEDDED_TICK_S, np.stack(zones),
                  (prices.CANT_BE_LATE_SPOT_USD_PER_HOUR,) * 2,
                  (prices.CANT_BE_LATE_ON_DEMAND_USD_PER_HOUR,) * 2)


def load_market(spot_dir: Path, folder: str, instance_type: str = DEFAULT_INSTANCE,
                region: str = "") -> MarketSource:
    """The zones of `folder` that offer `instance_type` (and, given a `region`, lie in it), with
    their prices; the embedded market when the folder is missing. A region the folder has no
    zone in keeps every zone, said so in the source (the provider's rule: the region's first
    zone, else its first zone)."""
    from cloud.traces import load_collection

    if not (Path(spot_dir) / folder).is_dir():
        return MarketSource(embedded_market(), f"embedded synthetic market (no traces at "
                                               f"{Path(spot_dir) / folder})", True)
    traces = [t for t in load_collection(folder, spot_dir).traces
              if t.instance_type in ("", instance_type)]
    if not traces:
        raise ValueError(f"trace folder {folder} has no zone with {instance_type}; set "
                         "TRAINWISE_SPOT_TRACES to a folder that has one")
    where = ""
    if region:
        local = [t for t in traces if (t.region or t.zone).startswith(region)]
        where = f", region {region}" if local else f", no zone in {region}: every region's"
        traces = local or traces
    market = market_from_traces(traces, tuple(t.spot_usd_per_hour for t in traces),
                                tuple(t.on_demand_usd_per_hour for t in traces))
    return MarketSource(market, f"{folder} ({len(traces)} zones{where}, {market.n_ticks} ticks "
                                f"of {market.tick_s} s)", False)


def completion_s(sim: SimResult, job: JobSpec, rules: ClusterRules, tick_s: float) -> float:
    """Seconds from the start to the end of the work: the finish inside the deadline, else the
    deadline (whole ticks, as the simulator applies it), one changeover and the remaining work
    on on-demand nodes (what the completion charge bills)."""
    if sim.finish_s is not None:
        return float(sim.finish_s)
    rate = job.node_count * job.gpus_per_node / rules.step_slowdown
    left_s = max(0.0, job.work_gpu_h - sim.useful_gpu_h) / rate * 3600.0
    horizon_s = math.floor(job.deadline_s / tick_s + 1e-9) * tick_s
    return horizon_s + rules.changeover_s + left_s


def forecast(scenarios: dict[str, tuple[str, float]], deadline_s: float, source: MarketSource,
             *, samples: int, seed: int = 0, rules: ClusterRules | None = None,
             node_count: int = 1) -> dict[str, PolicyForecast]:
    """Monte Carlo per scenario. `scenarios` maps a label to (allocation policy name, work in
    GPU-hours of its schedule), run as a gang of `node_count` nodes. Every scenario sees the same
    start ticks (common random numbers: a difference between two rows is the schedules', not the
    draw's). Each result also holds the completion time of every start (`finish_s`)."""
    if samples < 1:
        raise ValueError(f"samples={samples} must be at least 1 (TRAINWISE_FORECAST_SAMPLES)")
    rules = rules or ClusterRules()
    market = source.market
    window = int(deadline_s // market.tick_s)
    if window > market.n_ticks:
        raise ValueError(f"deadline {deadline_s / 3600:.1f} h is longer than the trace "
                         f"({market.n_ticks * market.tick_s / 3600:.1f} h); shorten "
                         "TRAINWISE_FORECAST_DEADLINE_H or pick a longer TRAINWISE_SPOT_TRACES")
    starts = np.random.default_rng(seed).integers(0, market.n_ticks - window + 1, size=samples)
    out: dict[str, PolicyForecast] = {}
    for label, (policy, work_gpu_h) in scenarios.items():
        job = JobSpec(work_gpu_h=work_gpu_h, deadline_s=deadline_s, node_count=node_count)
        result = PolicyForecast(label, work_gpu_h, [])
        for start in starts:
            sim = simulate(make_policy(policy), job, rules,
                           market.window(int(start), window))
            result.costs_usd.append(sim.cost_usd)
            result.deadline_missed += not sim.deadline_met
            result.finish_s.append(completion_s(sim, job, rules, market.tick_s))
        out[label] = result
    return out


def plot(forecasts: dict[str, PolicyForecast], budget_usd: float, path: Path) -> Path:
    """Box plot of spend per policy with the budget line, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = list(forecasts)
    ax.boxplot([forecasts[k].costs_usd for k in labels], whis=(10, 90), showfliers=False)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=20, fontsize=8)
    ax.axhline(budget_usd, color="red", linestyle="--", label=f"budget {budget_usd:.0f} USD")
    ax.set_ylabel("spend of the next run (USD)")
    ax.set_title("cost forecast: box = P25-P75, whiskers = P10-P90")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
