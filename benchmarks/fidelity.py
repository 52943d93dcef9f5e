"""Fidelity: the simulator's predicted cost, completion time and preemptions against the emulated
run's measured ones, for the same real trace window and the same allocation policy (issue 10.4).

    python -m benchmarks.fidelity [--quick] [--steps 60] [--windows 12]
        [--multi-zone-windows 3] [--gang-windows 3] [--policy NAME]

Three kinds of window: single-zone (one node, one zone; 12), multi-zone (one node, every zone of
the 2023-02 availability folder replayed together, the policy may move; 3) and gang-4 (a 4-node
gang on the 4-node trace, one zone; 3). `--quick`: one of each.

Two sources, never mixed:

- measured: the product's driver (`trainwise.runs.run_training` under the request's
  `allocation_policy`, `benchmarks/driver_run.py`): real trainer processes on this machine standing
  for the node (a gang's ranks: one process, see that module), the real spot trace window
  replayed at `--seconds-per-tick`, SIGTERM on reclaim, billed by the emulated provider per
  node-second (`cloud/providers/emulated.py`);
- predicted: `cloud.simulator.simulate` (the trace-driven simulator the cost suite uses) on the
  same window (`Market` built from the same `ReplayMarket` availability and prices of every
  zone), the same job (work, deadline, node count) and the same policy, with its rules
  calibrated as below.

Calibration (measured, not constants; `fidelity_calibrate.py`): before any window is scored,
`on_demand` runs on calibration windows in zones that are not scored give, from their own
telemetry, the emulated seconds of training per step (the clock runs at tick_s/seconds_per_tick
emulated seconds per wall second, so this is this machine's step time, evals included), the
checkpoint save cost (the trainer's `save_ms` of its interval checkpoints) and the changeover
(the configured one the emulated provider imposes, plus the first step's warm-up measured from
the trainers' telemetry: `fidelity_calibrate.warmup_s`; every step, the first too, is on the
emulated clock). An on-demand run is never
preempted, so those figures do not depend on the scored windows' spot availability, and the
policy's behaviour on the scored windows plays no part in them: not circular. Restore runs while
the replacement boots, inside the changeover (the emulated clock is frozen while a trainer
process starts), so it has no separate term.

The policy sees the same numbers in both (`SameView`): the emulated trainer checkpoints every
`checkpoint_every_steps` steps whatever the policy asks (issue 10: the policy's interval does not
reach the emulated trainer), so the simulator's interval is pinned to that, and the observation's
save cost and interval are the emulated run's.

Writes benchmarks/results/fidelity.{md,json} and fidelity.png (predicted vs measured). The
windows are picked in `fidelity_windows.py`; the summaries, plot and markdown are
`fidelity_report.py`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.driver_run import run_job, workspace
from benchmarks.fidelity_calibrate import Calibration, calibrate, same_run

# The windows and the report have their own modules; re-exported here, where the tests look
# for the benchmark's names.
from benchmarks.fidelity_report import (
    GOAL_REL_ERR,
    NOT_COVERED,
    RULE_DIFFERENCES,
    pct,
    plot,
    summarise,
    summarise_by_kind,
    to_markdown,
)
from benchmarks.fidelity_windows import (
    CALIBRATION_WINDOWS,
    GANG_FILES,
    KINDS,
    MULTI_ZONE_HOMES,
    Window,
    pick_gang_windows,
    pick_multi_zone_windows,
    pick_windows,
    spot_dir,
)
from benchmarks.results_io import provenance, write_results
from cloud import emulated as replay
from cloud.policy_registry import make_policy
from cloud.simulator import ClusterRules, JobSpec, Market, SimResult, simulate
from trainwise.emulated import EmulatedResult, ReplaySpec, risk_model_kwargs

__all__ = ["CALIBRATION_WINDOWS", "KINDS", "Market", "SameView", "Window", "emulated_rules_adjustment",
           "main", "make_policy", "pick_gang_windows", "pick_multi_zone_windows", "pick_windows",
           "predict", "prediction", "rel_err", "sim_market", "summarise", "summarise_by_kind",
           "to_markdown"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "fidelity"
DEADLINE_FACTOR = 2.0


class SameView:
    """The policy under test, shown what the emulated run shows it: its work figures (the
    emulated run states work as steps done / max_steps x its `work_total_h`), the emulated
    trainer's save cost and checkpoint interval, the emulated provider's configured changeover
    (`changeover_s`; None: the simulator's own); its interval requests are dropped (the
    emulated trainer checkpoints every N steps whatever the policy asks).

    The changeover matters (issue 10): the emulated observation states the provider's 360 s,
    the simulator's rule is the calibrated one (that plus the first step's warm-up); the
    heuristic solves its slack plan on the figure it is shown, so with two figures the two
    sides ran two plans, and the on-demand/wait calls of the outlier windows differed."""

    def __init__(self, inner: Any, save_s: float, interval_s: float, work_total_h: float,
                 changeover_s: float | None = None) -> None:
        self.inner, self.save_s, self.interval_s = inner, save_s, interval_s
        self.work_total_h, self.changeover_s = work_total_h, changeover_s
        self.name = getattr(inner, "name", type(inner).__name__)

    def act(self, observation: Any) -> Any:
        scale = self.work_total_h / observation.work_total_h
        if self.changeover_s is not None:
            # As `cloud.emulated.build_gang_observation`: the stated changeover from launch.
            holding = observation.zone is not None
            left_s = (max(0.0, self.changeover_s - observation.since_launch_s) if holding
                      else 0.0)
            observation = replace(observation, changeover_s=self.changeover_s,
                                  changeover_left_s=left_s, in_changeover=left_s > 0)
        seen = replace(observation, checkpoint_save_s=self.save_s,
                       checkpoint_interval_s=self.interval_s,
                       work_done_h=observation.work_done_h * scale,
                       work_checkpointed_h=observation.work_checkpointed_h * scale,
                       work_total_h=self.work_total_h)
        return replace(self.inner.act(seen), checkpoint_interval_s=None)


def sim_market(emulated: EmulatedResult, window: Window) -> tuple[Market, replay.ReplayMarket]:
    """The simulator's market: the very availability array and prices the emulated run
    replayed (`load_replay_market` with the run's window start and length)."""
    probe = replay.load_replay_market(window.folder, window.zone_file, window.start_tick, 1,
                                      spot_dir())
    ticks = replay.window_ticks(emulated.deadline_s, probe.tick_s)
    rms = [replay.load_replay_market(window.folder, f, window.start_tick, ticks, spot_dir())
           for f in window.zone_files]
    # After the window (or a shorter file's end) the emulated market reads "no spot"
    # (available_at): pad the same way, every zone to the same length.
    available = np.stack([np.concatenate([rm.available, np.zeros(2 * ticks - len(rm.available),
                                                                  dtype=np.int64)])
                          for rm in rms])
    rm = rms[0]
    market = Market(tuple(m.zone for m in rms), rm.tick_s, available,
                    tuple(m.spot_usd_per_hour for m in rms),
                    tuple(m.on_demand_usd_per_hour for m in rms),
                    float(rm.window_start_tick * rm.tick_s))
    return market, rm


def predict(emulated: EmulatedResult, window: Window, cal: Calibration, policy_name: str
            ) -> SimResult:
    """The simulator's figures for the emulated run's job on its window, calibrated rules."""
    market, rm = sim_market(emulated, window)
    # The emulated trainer reports completed steps and finishes its step in flight inside a
    # reclaim's notice, then saves: the simulator's stepped rule (`ClusterRules.train_step_s`).
    rules = ClusterRules(changeover_s=cal.changeover_s, checkpoint_save_s=cal.save_s,
                         checkpoint_interval_s=cal.checkpoint_interval_s,
                         train_step_s=cal.pure_step_s)
    # The simulator's run time is pure training (the calibrated step time less the periodic
    # saves, which the simulator adds itself); the emulated run's work is the same figure.
    # A gang's work is GPU-hours at node_count reference GPUs, as the emulated run states it.
    job = JobSpec(work_gpu_h=window.nodes * cal.pure_step_s * cal.steps / 3600.0,
                  deadline_s=emulated.deadline_s, node_count=window.nodes)
    inner = make_policy(policy_name, **risk_model_kwargs(policy_name, rm, window.folder,
                                                         spot_dir()))
    emulated_work_h = window.nodes * (emulated.deadline_s / DEADLINE_FACTOR
                                      - cal.emulated_changeover_s) / 3600
    policy = SameView(inner, cal.emulated_save_s, cal.emulated_interval_s, emulated_work_h,
                      cal.emulated_changeover_s)
    return simulate(policy, job, rules, market, record_events=True)


@dataclass(frozen=True)
class SimSet:
    """A node set the simulated job held: `spot` + `on_demand` nodes in zone index `zone`."""

    zone: int
    spot: int
    on_demand: int

    def usd_per_hour(self, market: Market) -> float:
        return (self.spot * market.spot_usd_per_hour[self.zone]
                + self.on_demand * market.on_demand_usd_per_hour[self.zone])


_LAUNCH = re.compile(r"^(\S+): (\d+) spot \+ (\d+) on-demand")


def set_changes(sim: SimResult, market: Market) -> list[tuple[float, str, SimSet | None]]:
    """The simulated job's held set over time, from its events: (time, event, set held after
    it), event "launch" (a new set), "preempted" or "release" (none held)."""
    out: list[tuple[float, str, SimSet | None]] = []
    for at, kind, text in sim.events:
        if kind == "launch":
            found = _LAUNCH.match(text)
            if found is None:
                raise ValueError(f"simulator launch event {text!r} does not name its set")
            out.append((at, kind, SimSet(market.zones.index(found.group(1)),
                                         int(found.group(2)), int(found.group(3)))))
        elif kind in ("preempted", "release"):
            out.append((at, kind, None))
    return out


def final_set(sim: SimResult, market: Market) -> SimSet | None:
    """The set the simulated job finished on (its last launch); None when it missed the
    deadline (the completion charge finishes the work on on-demand)."""
    if sim.finish_s is None:
        return None
    for _, kind, held in reversed(set_changes(sim, market)):
        if kind == "launch":
            return held
    raise ValueError(f"simulated run finished at {sim.finish_s} s without a launch event")


def tail_billed_s(sim: SimResult, market: Market, cal: Calibration, notice_s: float) -> float:
    """Seconds the final set is billed after the last step: the measured tail, cut short (at
    the next reclaim plus its notice) when it holds spot and the trace takes one of them."""
    held = final_set(sim, market)
    if held is None or not held.spot or sim.finish_s is None:
        return cal.tail_s
    tick = float(market.tick_s)
    first = int(sim.finish_s // tick) + 1
    for t in range(first, market.n_ticks):
        if t * tick >= sim.finish_s + cal.tail_s:
            break
        if market.spot_available[held.zone, t] < held.spot:
            return min(cal.tail_s, t * tick + notice_s - sim.finish_s)
    return cal.tail_s


def emulated_rules_adjustment(sim: SimResult, market: Market, cal: Calibration,
                              nodes: int = 1) -> dict[str, float]:
    """What the emulated provider bills that the simulator has no rule for (`cloud/emulated.py`
    billing rule), added to the simulator's figures:

    - a reclaimed set (a gang: every node) is billed until its trainer exits, at most the
      notice (its shutdown always outlasts the notice at replay speed: the clock is frozen while
      it checkpoints and exits);
    - a set left for another one (zone move, spot/on-demand switch) or released is billed the
      same way, where the simulator bills one checkpoint save on it: the difference;
    - the last trainer's exit after its final checkpoint (the calibrated tail) runs on the clock
      on the final set.
    """
    notice_s = replay.default_rules().notice_s
    stop_usd = switch_usd = 0.0
    held: SimSet | None = None
    for _, kind, after in set_changes(sim, market):
        if kind == "preempted" and held is not None:
            stop_usd += notice_s * held.usd_per_hour(market) / 3600.0
        elif held is not None:  # a launch replacing the held set, or a release
            switch_usd += max(0.0, notice_s - cal.save_s) * held.usd_per_hour(market) / 3600.0
        held = after
    final = final_set(sim, market)
    price = (final.usd_per_hour(market) if final is not None
             else nodes * min(market.on_demand_usd_per_hour))
    if cal.tail_frozen:
        # The clock stopped at the last step; the final set is billed as a shutdown: the
        # trainer's exit at replay speed, at most the notice, which it always outlasts.
        tail_s, tail_completion_s = notice_s, 0.0
    else:
        tail_s, tail_completion_s = tail_billed_s(sim, market, cal, notice_s), cal.tail_s
    return {"notice_billing_usd": stop_usd, "switch_billing_usd": switch_usd,
            "tail_billed_s": tail_s, "tail_usd": tail_s * price / 3600.0,
            "tail_completion_s": tail_completion_s}


def predicted_finish_s(sim: SimResult, cal: Calibration, deadline_s: float, tick_s: float,
                       nodes: int = 1) -> float:
    """Completion time: the simulator's finish, or (deadline missed) the deadline in whole ticks
    plus the changeover and the remaining work on on-demand, as its completion charge bills
    (`useful_gpu_h` is GPU-hours: a gang's `nodes` do it together)."""
    if sim.finish_s is not None:
        return float(sim.finish_s)
    left_s = max(0.0, cal.pure_step_s * cal.steps - sim.useful_gpu_h * 3600.0 / nodes)
    return math.floor(deadline_s / tick_s + 1e-9) * tick_s + cal.changeover_s + left_s


def rel_err(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; a measured 0 gives 0 when both are 0, else inf."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - measured) / measured


def aligned_step_wall_s(cal: Calibration, window: Window) -> float:
    """The emulated run's step estimate, nudged up so that its deadline (DEADLINE_FACTOR x
    (work + changeover)) falls on a tick boundary: the simulator rounds deadlines down to whole
    ticks, so both then apply the same deadline and the policy sees the same slack."""
    tick_s = float(replay.load_replay_market(window.folder, window.zone_file, window.start_tick,
                                             1, spot_dir()).tick_s)
    work_s = cal.pure_step_s * cal.steps
    deadline_s = math.ceil(DEADLINE_FACTOR * (work_s + cal.emulated_changeover_s) / tick_s
                           - 1e-9) * tick_s
    aligned_work_s = deadline_s / DEADLINE_FACTOR - cal.emulated_changeover_s
    return aligned_work_s / cal.steps / cal.emulated_per_wall_s


def score_window(window: Window, cal: Calibration, args: argparse.Namespace, work: Path,
                 index: int, previous: EmulatedResult | None = None
                 ) -> tuple[dict[str, Any], EmulatedResult]:
    """One window's row and its emulated run. `previous`: the run scored just before (its
    telemetry gives the previous-run calibration)."""
    tick_s = float(replay.load_replay_market(window.folder, window.zone_file, window.start_tick,
                                             1, spot_dir()).tick_s)
    cal = cal.at_rate(tick_s / args.seconds_per_tick)  # this trace's replay speed
    # The product's driver (the `train` job's run_training, supervised engine).
    emulated = run_job(
        workspace(work, args.partition), args.partition, max_steps=args.steps,
        policy_name=args.policy, run_id=f"fidelity-{index:02d}",
        train_overrides=cal.train_overrides,
        replay=ReplaySpec(trace_folder=window.folder, zone_files=tuple(window.zone_files),
                          nodes=window.nodes, window_start_tick=window.start_tick,
                          seconds_per_tick=args.seconds_per_tick,
                          deadline_factor=DEADLINE_FACTOR,
                          step_wall_s_estimate=aligned_step_wall_s(cal, window),
                          max_wall_s=args.max_wall_s, freeze_after_last_step=cal.tail_frozen))
    measured = {"cost_usd": emulated.cost_usd,
                "completion_s": float(emulated.finish_s) if emulated.finish_s is not None
                else float("nan"),
                "preemptions": emulated.preemptions}
    row: dict[str, Any] = {
        "window": asdict(window), "status": emulated.status,
        "measured_source": "emulated run (trainer processes, emulated provider bill)",
        "predicted_source": "cloud.simulator.simulate (calibrated rules)",
        "measured": measured,
        "emulated": {"spot_share": emulated.spot_share, "launches": emulated.launches,
                     "zones_held": list(emulated.zones_held),
                     "node_launches": emulated.node_launches,
                     "resumes": emulated.resumes, "notices_missed": emulated.notices_missed,
                     "deadline_s": emulated.deadline_s, "wall_s": round(emulated.wall_s, 2),
                     "stopping_node_s": emulated.stopping_node_s,
                     "holdings": list(emulated.holdings)}}
    # Headline: calibrated on other windows' runs before any scoring; second: the machine's
    # speed in the run scored just before this one (the newest telemetry a forecast made before
    # this run could have: the machine drifts over minutes); third: the scored run's own speeds.
    earlier = same_run(cal, previous) if previous is not None else cal
    for key, used in (("", cal), ("previous_run_", earlier),
                      ("same_run_", same_run(cal, emulated))):
        row.update({f"{key}{k}": v for k, v in
                    prediction(emulated, window, used, args.policy, measured).items()})
    row["same_run_calibration"] = {k: v for k, v in same_run(cal, emulated).record().items()
                                   if k in ("step_s", "save_s", "tail_s", "pure_step_s")}
    return row, emulated


def prediction(emulated: EmulatedResult, window: Window, cal: Calibration, policy: str,
               measured: dict[str, Any]) -> dict[str, Any]:
    """The simulator's figures for one emulated run under calibration `cal`, with errors. A job
    the simulator refuses (the calibrated work does not fit the emulated run's deadline) gives
    NaN figures and the simulator's message."""
    try:
        sim = predict(emulated, window, cal, policy)
    except ValueError as error:
        nan = float("nan")
        return {"predicted": {"cost_usd": nan, "completion_s": nan, "preemptions": -1},
                "rel_err": {"cost": nan, "completion": nan}, "preemptions_diff": None,
                "simulator_error": str(error)}
    market, _ = sim_market(emulated, window)
    tick_s = float(market.tick_s)
    raw_finish = predicted_finish_s(sim, cal, emulated.deadline_s, tick_s, window.nodes)
    extra = emulated_rules_adjustment(sim, market, cal, window.nodes)
    predicted = {"cost_usd": sim.cost_usd + extra["notice_billing_usd"]
                 + extra["switch_billing_usd"] + extra["tail_usd"],
                 "completion_s": raw_finish + extra["tail_completion_s"],
                 "preemptions": sim.preemptions}
    return {
        "predicted": predicted,
        "rel_err": {"cost": rel_err(predicted["cost_usd"], measured["cost_usd"]),
                    "completion": rel_err(predicted["completion_s"], measured["completion_s"])},
        "preemptions_diff": predicted["preemptions"] - measured["preemptions"],
        # The simulator's own figures before the emulated billing rules it lacks are added.
        "simulator_raw": {"cost_usd": sim.cost_usd, "completion_s": raw_finish,
                          "rel_err_cost": rel_err(sim.cost_usd, measured["cost_usd"]),
                          "rel_err_completion": rel_err(raw_finish, measured["completion_s"])},
        "emulated_rules_adjustment": extra,
        "simulated": {"spot_share": sim.spot_share, "changeovers": sim.changeovers,
                      "deadline_met": sim.deadline_met,
                      "checkpoint_node_s": sim.checkpoint_node_s,
                      "lost_node_s": sim.lost_node_s, "completion_usd": sim.completion_usd},
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.fidelity")
    parser.add_argument("--quick", action="store_true",
                        help="20 steps, 1 calibration run, one window of each kind (tests)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--windows", type=int, default=None,
                        help="single-zone windows (default 12; --quick: 1)")
    parser.add_argument("--multi-zone-windows", type=int, default=None,
                        help=f"multi-zone windows (default {len(MULTI_ZONE_HOMES)}; --quick: 1)")
    parser.add_argument("--gang-windows", type=int, default=None,
                        help=f"4-node gang windows (default {len(GANG_FILES)}; --quick: 1)")
    parser.add_argument("--policy", default="trainwise_heuristic")
    parser.add_argument("--partition", default="pystdlib")
    parser.add_argument("--seconds-per-tick", type=float, default=0.2)
    parser.add_argument("--max-wall-s", type=float, default=300.0)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--tail-on-clock", action="store_true",
                        help="the old rule: the last trainer's final eval, checkpoint and exit "
                             "run on the emulated clock (default: clock frozen, billed as a "
                             "shutdown)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    if args.windows is None:
        args.windows = 1 if args.quick else 12
    if args.multi_zone_windows is None:
        args.multi_zone_windows = 1 if args.quick else len(MULTI_ZONE_HOMES)
    if args.gang_windows is None:
        args.gang_windows = 1 if args.quick else len(GANG_FILES)
    started = time.monotonic()
    windows = (pick_windows(args.windows) + pick_multi_zone_windows(args.multi_zone_windows)
               + pick_gang_windows(args.gang_windows))
    wanted = args.windows + args.multi_zone_windows + args.gang_windows
    if len(windows) < wanted:
        print(f"only {len(windows)} windows found under {spot_dir()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="trainwise-fidelity-") as tmp:
        work = Path(tmp)
        cal = calibrate(CALIBRATION_WINDOWS[:1] if args.quick else CALIBRATION_WINDOWS,
                        args.partition, args.steps, args.seconds_per_tick, work,
                        args.max_wall_s, freeze_after_last_step=not args.tail_on_clock)
        rows, previous = [], None
        for i, window in enumerate(windows):
            row, previous = score_window(window, cal, args, work, i, previous)
            rows.append(row)
            print(f"{i:2d} {window.kind} {window.label}: cost "
                  f"{pct(row['rel_err']['cost'])} completion {pct(row['rel_err']['completion'])} "
                  f"preemptions {row['predicted']['preemptions']}/{row['measured']['preemptions']}",
                  flush=True)
    payload = {"policy": args.policy, "steps": args.steps, "quick": args.quick,
               "seconds_per_tick": args.seconds_per_tick, "goal_rel_err": GOAL_REL_ERR,
               "calibration": cal.record(), "windows": rows, "summary": summarise(rows),
               "summary_same_run": summarise(rows, "same_run_"),
               "summary_previous_run": summarise(rows, "previous_run_"),
               "summary_by_kind": summarise_by_kind(rows),
               "summary_by_kind_same_run": summarise_by_kind(rows, "same_run_"),
               "rule_differences": RULE_DIFFERENCES,
               "not_covered": NOT_COVERED,
               "wall_s": round(time.monotonic() - started, 1)}
    out = Path(args.out_dir)
    plot(rows, out / f"{NAME}.png")
    write_results(out, NAME, payload, to_markdown(payload),
                  provenance(["python", "-m", "benchmarks.fidelity", *argv]))
    print(to_markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
