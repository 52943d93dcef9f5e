"""Where every dollar of one training run went (`trainwise explain RUN --summary`, issue 28).

`summarize(run_dir)` reads one run folder only (no network, no MLflow) and splits the provider's
bill for the run (node-seconds at the price paid, boots, changeovers, notices and idle included)
two ways, each adding up to the bill to the cent:

- by market: spot and on-demand node-seconds and their USD;
- by use: the first boot (the fixed schedule pays it too), the changeovers after it, notice time
  (a node told to stop is billed until it is down; the trainer saves in it), replayed work,
  checkpoint saves while training, the tail after the last step, straggler idle (torchrun
  ranks waiting at the all-reduce), nodes idle while a rank's replacement boots, and productive
  training: the remainder, which closes the sum. The rows the engine counts as preemption waste
  (the bill's node-seconds beyond the fixed schedule) add up to its recorded waste.

Then the saving against the fixed on-demand schedule and the data skipped by selection. Each row
names the decisions that caused it (the decision records' policy and reason, or counts by
policy). A figure the folder cannot give is None with the reason, never a made-up 0.

Where the bill lives: `supervised.json` (the supervised engine, `trainwise.supervised_run`: every
node's launch, notice and end in `figures.holdings`) or `gang.json` (the in-process engine, or
the node-agent engine when `trainwise.agent_launch` ran the job on its nodes; `trainwise.gang`:
launches and notices in `history`, the bill, the seconds trained; a reclaimed node's minutes
after its notice are not timed there, so they are the bill's remainder over the timed
node-seconds). Node-seconds are on the provider's clock: the emulated provider replays its
trace fast (`speed` provider seconds per wall second), so a 50 ms save on this machine is billed
as 50 ms x speed node-seconds.

The rows and their printing are `trainwise.cost_rows`; each engine's split of the bill is
`trainwise.cost_engines`; this module adds the telemetry's figures and puts the rows together.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from pathlib import Path
from typing import Any

from cloud.emulated import replayed
from telemetry.reader import read_run_events
from trainwise.cost_engines import _answers, _Bill, _gang, _load, _Part, _short, _supervised
from trainwise.cost_rows import (
    AFTER_NOTICE_SAVES,
    AGAINST,
    DATA,
    FINAL_SAVE,
    GANG_FILE,
    KNOWN,
    MARKET,
    SUBTOTAL,
    SUPERVISED_FILE,
    USE,
    CostRow,
    CostSummary,
)

# The engines whose bill is gang.json's (trainwise.gang): the job in this process or a torchrun
# gang it started ("in-process"), or the node agents of trainwise.agent_launch ("node-agent").
GANG_ENGINES = ("in-process", "node-agent")


# -- figures from the telemetry ----------------------------------------------------------------
def _rank0(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind and e.get("rank", 0) == 0]


def _priced(bill: _Bill, events: list[dict[str, Any]]):
    """wall time -> (nodes, USD per hour) of the set held then: the k-th trainer start (rank 0)
    trained on the k-th set launched; without that pairing, the bill's mean price."""
    starts = [e["wall_time_s"] for e in _rank0(events, "run_start")]
    billed_s = sum(bill.parts[k].node_s or 0.0 for k in ("spot", "on_demand"))
    mean = bill.bill_usd * 3600.0 / billed_s if billed_s else 0.0
    paired = len(starts) == len(bill.sets) and starts == sorted(starts)
    if not paired and starts:
        bill.notes.append(f"{len(starts)} trainer starts for {len(bill.sets)} node sets: saves "
                          "and waits priced at the bill's mean price per node-second")

    def at(wall: float) -> tuple[int, float]:
        if not paired:
            return bill.nodes, mean * bill.nodes
        return bill.sets[max(0, bisect.bisect_right(starts, wall) - 1)]

    return at


def _on_clock(bill: _Bill, wall_s: float, at_wall: float, priced, part: _Part,
              per_node: bool = False) -> None:
    """Adds `wall_s` seconds of this machine, billed at the replay speed, to `part`."""
    nodes, usd_per_hour = priced(at_wall)
    clock_s = wall_s * (bill.speed or 0.0)
    if per_node:  # one rank's wait: its own node only
        part.add(clock_s, usd_per_hour / nodes)
    else:
        part.add(clock_s * nodes, usd_per_hour / nodes)


def _telemetry_parts(bill: _Bill, events: list[dict[str, Any]]) -> dict[str, _Part]:
    if not events:  # unknown, not none: every row measured from the telemetry says so
        keys = ["checkpoint", "straggler"] + (["replayed"] if bill.engine in GANG_ENGINES else [])
        if "tail" not in bill.waste_keys and bill.engine != "in-process":
            keys.append("tail")
        return {k: _Part(None, None, "", "no readable telemetry in the run folder") for k in keys}
    priced = _priced(bill, events)
    saves = _rank0(events, "checkpoint")

    def blocking_s(e: dict[str, Any]) -> float:  # a background save stalls only its snapshot
        ms = e.get("snapshot_ms") if e.get("asynchronous") else e.get("save_ms")
        return float(ms or 0.0) / 1000.0

    during = [e for e in saves if e.get("reason") not in AFTER_NOTICE_SAVES | {FINAL_SAVE}]
    after = [e for e in saves if e.get("reason") in AFTER_NOTICE_SAVES]
    final = [e for e in saves if e.get("reason") == FINAL_SAVE]
    checkpoint = _Part()
    for e in during:
        _on_clock(bill, blocking_s(e), e["wall_time_s"], priced, checkpoint)
    reasons = Counter(e.get("reason") for e in during)
    checkpoint.caused_by = (
        f"{len(during)} save(s) while training ({', '.join(f'{r} x{n}' for r, n in reasons.items()) or 'none'}"
        f", {sum(map(blocking_s, during)) * 1000:.0f} ms); {len(after)} save(s) after a notice "
        f"({sum(map(blocking_s, after)) * 1000:.0f} ms) are inside the notice time")
    if during and bill.speed is None:
        checkpoint.node_s = checkpoint.usd = None
        checkpoint.why_missing = bill.speed_why
    parts = {"checkpoint": checkpoint}

    tail = bill.parts.get("tail", _Part())
    final_ms = sum(map(blocking_s, final)) * 1000
    if bill.engine == "in-process":
        tail.caused_by = (f"none billed: the provider clock stops at the last fast tick, so the "
                          f"final eval and save ({final_ms:.0f} ms) are not on the bill")
    elif bill.engine == "node-agent":
        tail.node_s = tail.usd = None
        tail.why_missing = (f"inside training: the launcher's clock runs until the node agents "
                            f"report the job's exit, so its final eval and save ({final_ms:.0f} "
                            "ms) and exit are billed as training")
    elif "tail" in bill.waste_keys:
        tail.caused_by = (f"final eval, save ({final_ms:.0f} ms) and exit, billed as a shutdown "
                          "(the clock froze at the last step)")
    elif bill.tail_wall is not None and bill.speed is not None:
        # The clock ran from the last step to the job's end (the trainer evaluating, saving,
        # exiting): the clock at the last step is the end's less those wall seconds x speed.
        # Billed as training until the last set stopped (a notice after it is notice time).
        last_step, end_wall, end_clock = bill.tail_wall
        at_last_step = end_clock - (end_wall - last_step) * bill.speed
        clock_s = min(max(0.0, min(bill.tail_stop_s, end_clock) - at_last_step),
                      bill.tail_cap_s)
        _on_clock(bill, clock_s / bill.speed, last_step, priced, tail)
        tail.caused_by = (f"final eval, save ({final_ms:.0f} ms) and trainer exit, on the replay "
                          f"clock from the last step (about {at_last_step:,.0f} s) until the "
                          f"node stopped ({min(bill.tail_stop_s, end_clock):,.0f} s)")
    else:
        tail.node_s = tail.usd = None
        tail.why_missing = bill.speed_why or "no end of the job in the telemetry"
    parts["tail"] = tail

    steps = _rank0(events, "step")
    world = max((int(e.get("world_size") or 1) for e in steps), default=1)
    straggler = _Part()
    if world < 2:
        # Not unknown but none: a single process has no all-reduce to wait at.
        straggler.caused_by = "n/a: one trainer process (no all-reduce to wait at)"
    else:
        waits = [e for e in events if e["type"] == "step" and e.get("allreduce_wait_ms")]
        for e in waits:
            _on_clock(bill, float(e["allreduce_wait_ms"]) / 1000.0, e["wall_time_s"], priced,
                      straggler, per_node=True)
        moved = sum(1 for e in events if e["type"] == "decision" and e.get("layer") == "fast"
                    and e.get("rank", 0) == 0
                    and len((e.get("action") or {}).get("rank_work_shares") or []) > 1
                    and len(set((e.get("action") or {})["rank_work_shares"])) > 1)
        straggler.caused_by = (f"{world} ranks waiting at the all-reduce; {moved} fast "
                               "decision(s) set uneven work shares")
        if waits and bill.speed is None:
            straggler.node_s = straggler.usd = None
            straggler.why_missing = bill.speed_why
    parts["straggler"] = straggler

    if bill.engine in GANG_ENGINES:  # re-run steps are training time on these engines
        again = [e for e, r in zip(steps, replayed(e["step"] for e in steps), strict=True) if r]
        rerun = _Part(caused_by=f"{len(again)} step(s) re-run after resumes"
                      + (" (billed as training by this engine, not as waste)" if again else
                         ": every resume started at the step saved at its notice"))
        for e in again:
            _on_clock(bill, float(e.get("step_time_ms") or 0.0) / 1000.0, e["wall_time_s"],
                      priced, rerun)
        if again and bill.speed is None:
            rerun.node_s = rerun.usd = None
            rerun.why_missing = bill.speed_why
        parts["replayed"] = rerun
    return parts


def _data_row(run_dir: Path, events: list[dict[str, Any]], telemetry: Path) -> CostRow:
    """Samples the data selection skipped: the consumption record (dynamic pruning), else the
    run's curriculum manifest in the state folder (static pruning)."""
    from trainwise.explain import consumption_records, lever_effects

    pruning = lever_effects(events, consumption_records(telemetry))["pruning"]
    if pruning["active"]:
        skipped = pruning["skipped_samples"]
        rates = ", ".join(f"{r:g}" for r in pruning["epoch_rates"][:6])
        text = (f"dynamic pruning skipped {skipped:,.0f} samples against full data"
                f" (epoch rates {rates or 'n/a'})" if skipped is not None else
                "dynamic pruning ran, its skipped count is not in the consumption record")
        return CostRow("data_skipped", "samples skipped by selection", DATA, None, None, None,
                       text, why_missing="" if skipped is not None else "no skipped count")
    outcome = _load(run_dir / "outcome.json") or {}
    request = _load(run_dir / "request.json") or {}
    version, partition = outcome.get("curriculum_version"), request.get("partition")
    manifest = (_load(run_dir.parent.parent / "curricula" / str(partition)
                      / f"curriculum-{version}.json") if version and partition else None)
    if manifest is None:
        return CostRow("data_skipped", "samples skipped by selection", DATA, None, None, None,
                       "static data selection",
                       why_missing="the run's curriculum manifest is not in the state folder")
    rate, pruned = float(manifest.get("pruning_rate") or 0.0), manifest.get("pruned")
    if pruned is None and rate > 0:
        return CostRow("data_skipped", "examples pruned by the curriculum", DATA, None, None,
                       None, f"curriculum {version}: rate {rate:g}",
                       why_missing="its manifest does not count the examples pruned")
    return CostRow("data_skipped", "examples pruned by the curriculum", DATA, None, None, None,
                   f"curriculum {version}: keeps {manifest.get('kept', 0):,} examples, prunes "
                   f"{pruned or 0:,} (rate {rate:g}; {_short(manifest.get('why', ''), 40)})")


# -- the summary ---------------------------------------------------------------------------------
USE_ROWS = (("first_boot", "first boot (fixed schedule too)"),
            ("changeovers", "changeovers after the first"),
            ("notice", "notice time"),
            ("replayed", "lost and replayed work"),
            ("checkpoint", "checkpoint saves while training"),
            ("tail", "after the last step"),
            ("straggler", "straggler idle"),
            ("gang_idle", "idle while a rank is replaced"))


def _read_events(telemetry: Path, notes: list[str]) -> list[dict[str, Any]]:
    if not telemetry.is_dir():
        notes.append(f"no telemetry at {telemetry}: saves, notices and waits are not recorded")
        return []
    try:
        return read_run_events(telemetry)
    except (OSError, ValueError) as error:  # a damaged segment: the bill still prints
        notes.append(f"telemetry unreadable ({error}): saves, notices and waits not recorded")
        return []


def summarize(run_dir: Path) -> CostSummary:
    """Where the run's bill went, from its folder `<state>/runs/<run_id>` alone."""
    run_dir = Path(run_dir)
    notes: list[str] = []
    telemetry = run_dir / "telemetry" / run_dir.name
    events = _read_events(telemetry, notes)
    preemptions = len(_rank0(events, "preemption"))
    data = _data_row(run_dir, events, telemetry)
    fast = str((_load(run_dir / "fast_policy.json") or {}).get("fast_policy", ""))
    supervised, gang = _load(run_dir / SUPERVISED_FILE), _load(run_dir / GANG_FILE)
    record, source = ((supervised, SUPERVISED_FILE) if supervised is not None
                      else (gang, GANG_FILE))
    if record is None or record.get("cost_usd") is None:
        why = (f"{source} holds no bill (the provider could not price the run)" if record
               else f"neither {SUPERVISED_FILE} (supervised engine) nor {GANG_FILE} (in-process "
               f"engine) is in {run_dir}: a run from before the provider's bill was recorded")
        return CostSummary(run_id=run_dir.name, run_dir=str(run_dir), engine="", bill_usd=None,
                           bill_source=why, rows=tuple(_known_rows(run_dir, events, fast, why)
                                                       + [data]),
                           preemptions=preemptions, notes=tuple(notes))
    parse = _supervised if supervised is not None else _gang
    bill = parse(record, events, source, fast)
    parts = {**bill.parts, **_telemetry_parts(bill, events)}
    return CostSummary(run_id=run_dir.name, run_dir=str(run_dir), engine=bill.engine,
                       bill_usd=bill.bill_usd, bill_source=source,
                       rows=tuple(_rows(bill, parts) + [data]), preemptions=preemptions,
                       notes=tuple(notes + bill.notes))


def _row(key: str, name: str, section: str, part: _Part | None, bill_usd: float,
         waste: bool = False) -> CostRow:
    part = part or _Part(None, None, "", "not in this engine's record")
    share = part.usd / bill_usd if part.usd is not None and bill_usd else None
    return CostRow(key, name, section, part.node_s, part.usd, share, part.caused_by,
                   part.why_missing, waste)


def _rows(bill: _Bill, parts: dict[str, _Part]) -> list[CostRow]:
    total = bill.bill_usd
    rows = [_row("spot", "spot", MARKET, parts["spot"], total),
            _row("on_demand", "on-demand", MARKET, parts["on_demand"], total)]
    if "unattributed" in parts:
        rows.append(_row("unattributed", "unattributed", MARKET, parts["unattributed"], total))
    use = [_row(key, name, USE, parts.get(key), total, key in bill.waste_keys)
           for key, name in USE_ROWS if not (key == "gang_idle" and bill.nodes < 2)]
    billed_s = (None if any(r.node_s is None for r in rows)
                else sum(r.node_s or 0.0 for r in rows))
    missing = [r.name for r in use if r.usd is None]
    # The remainder closes the sum: the money rows add up to the bill exactly.
    usd = total - sum(r.usd for r in use if r.usd is not None)
    node_s = (None if billed_s is None else
              billed_s - sum(r.node_s for r in use if r.node_s is not None))
    productive = CostRow(
        "productive", "productive training (remainder)", USE, node_s, usd,
        usd / total if total else None,
        "first-time training steps and evals: the bill less every row above"
        + (f"; includes what is not recorded above: {', '.join(missing)}" if missing else ""),
        "" if node_s is not None else "the total node-seconds are not known")
    if usd < -0.005:
        bill.notes.append(f"the rows above exceed the bill by {-usd:.2f} USD: a figure is "
                          "overestimated")
    waste = [r for r in use if r.waste]
    waste_s = (None if any(r.node_s is None for r in waste)
               else sum(r.node_s or 0.0 for r in waste))
    recorded = bill.waste_node_s
    waste_row = CostRow(
        "waste", "preemption waste", SUBTOTAL, waste_s,
        None if any(r.usd is None for r in waste) else sum(r.usd or 0.0 for r in waste),
        None, " + ".join(r.name.split(" (")[0] for r in waste) + (
            f"; the bill's waste in {bill.source}: {recorded:,.0f} node-s beyond the fixed "
            "schedule" if recorded is not None else ""))
    waste_row = CostRow(**{**waste_row.__dict__, "share_of_bill": (
        waste_row.usd / total if waste_row.usd is not None and total else None)})
    if recorded is not None and waste_s is not None and abs(waste_s - recorded) > 1.0:
        bill.notes.append(f"the waste rows ({waste_s:,.0f} node-s) differ from the bill's "
                          f"recorded waste ({recorded:,.0f} node-s)")
    return rows + use + [productive, waste_row, _saving_row(bill)]


def _saving_row(bill: _Bill) -> CostRow:
    fixed = bill.fixed_usd
    if fixed is None or not math.isfinite(fixed):
        return CostRow("saving", "saving", AGAINST, None, None, None, "",
                       why_missing=f"no fixed on-demand schedule in {bill.source}")
    saving = fixed - bill.bill_usd
    return CostRow(
        "saving", "saving", AGAINST, None, saving, None,
        f"{saving / fixed:.1%} of the fixed schedule's {fixed:,.2f} USD: {bill.nodes} node(s) "
        f"on demand for one changeover ({bill.changeover_s:,.0f} s) + {bill.trained_s:,.0f} s "
        "trained, never interrupted", share_of_fixed=saving / fixed if fixed else None)


def _known_rows(run_dir: Path, events: list[dict[str, Any]], fast: str,
                why: str) -> list[CostRow]:
    """A run without a bill: what its folder still tells."""
    outcome = _load(run_dir / "outcome.json") or {}
    saves = _rank0(events, "checkpoint")
    save_ms = sum(float(e.get("save_ms") or 0.0) for e in saves)
    ends = [float(e["cost_usd"]) for e in _rank0(events, "run_end") if e.get("cost_usd")]
    # outcome.json names it compute_estimate_usd; one written before the bill was the cost
    # shown called it cost_usd.
    estimate = outcome.get("compute_estimate_usd", outcome.get("cost_usd", max(ends, default=None)))
    return [
        CostRow("bill", "provider's bill", KNOWN, None, None, None, "", why_missing=why),
        CostRow("trainer_estimate", "trainer's own estimate", KNOWN, None,
                float(estimate) if estimate is not None else None, None,
                "wall time x list price (outcome.json or the trainer's run end), not what a "
                "provider charged",
                why_missing="" if estimate is not None else "no outcome.json, no run end"),
        CostRow("checkpoint", "checkpoint saves", KNOWN, None, None, None,
                f"{len(saves)} save(s), {save_ms:,.0f} ms on this machine"),
        CostRow("notice", "preemption notices", KNOWN, None, None, None,
                f"{len(_rank0(events, 'preemption'))} notice(s); {_answers(events, fast)}"),
    ]
