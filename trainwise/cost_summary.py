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
node's launch, notice and end in `figures.holdings`) or `gang.json` (the in-process engine,
`trainwise.gang`: launches and notices in `history`, the bill, the seconds trained; a reclaimed
node's minutes after its notice are not timed there, so they are the bill's remainder over the
timed node-seconds). Node-seconds are on the provider's clock: the emulated provider replays its
trace fast (`speed` provider seconds per wall second), so a 50 ms save on this machine is billed
as 50 ms x speed node-seconds.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloud.emulated import replayed
from telemetry.reader import read_run_events

SUPERVISED_FILE = "supervised.json"  # trainwise.supervised_run.RECORD_FILE
GANG_FILE = "gang.json"  # trainwise.gang.GANG_FILE
PROVIDER_RANK = 1000  # the provider's telemetry rank (trainwise.gang / trainwise.emulated)
NOT_RECORDED = "not recorded"
# Saves a trainer makes after it was told to stop (billed inside the notice time) and at the end.
AFTER_NOTICE_SAVES = {"preemption", "migrate_fallback"}
FINAL_SAVE = "final"
MARKET, USE, SUBTOTAL, AGAINST, DATA = "market", "use", "subtotal", "against", "data"
KNOWN = "known"  # what a run without a bill still tells


@dataclass(frozen=True)
class CostRow:
    key: str  # the metadata name, e.g. "notice"
    name: str
    section: str  # MARKET, USE (these two each add up to the bill), SUBTOTAL, AGAINST, DATA
    node_s: float | None
    usd: float | None
    share_of_bill: float | None
    caused_by: str
    why_missing: str = ""  # why node_s or usd is None
    waste: bool = False  # part of the bill's preemption waste (beyond the fixed schedule)
    share_of_fixed: float | None = None  # the saving row: its share of the fixed schedule


@dataclass(frozen=True)
class CostSummary:
    run_id: str
    run_dir: str
    engine: str  # "supervised", "in-process", or "" without a bill
    bill_usd: float | None
    bill_source: str  # the file the bill was read from, or why there is none
    rows: tuple[CostRow, ...]
    preemptions: int  # the trainer's preemption events (rank 0) in the telemetry
    notes: tuple[str, ...] = ()

    def row(self, key: str) -> CostRow:
        return next(r for r in self.rows if r.key == key)

    def money_rows(self, section: str) -> list[CostRow]:
        return [r for r in self.rows if r.section == section]

    @property
    def productive_share(self) -> float | None:
        return self.row("productive").share_of_bill if self.bill_usd is not None else None

    def markdown(self) -> str:
        """The table, for an MLflow artifact."""
        lines = [f"# Where every dollar went: run {self.run_id}", "", self._headline(), "",
                 "| section | item | node-s | USD | share of bill | caused by |",
                 "|---|---|---:|---:|---:|---|"]
        for row, cents in zip(self.rows, self._shown_cents(), strict=True):
            lines.append(f"| {row.section} | {row.name} | {_node_s(row)} | {_usd(row, cents)} | "
                         f"{_share(row)} | {_cell(row)} |")
        return "\n".join(lines + [""] + [f"- {n}" for n in self.notes])

    def text(self) -> str:
        """The CLI screen: one table a CFO can read, each row's causes on the line below it."""
        width = 40
        out = [self._headline(), ""]
        titles = {MARKET: "by market (adds up to the bill)", USE: "by use (adds up to the bill)",
                  SUBTOTAL: "", AGAINST: "against the fixed on-demand schedule",
                  DATA: "data selection", KNOWN: "known without a bill"}
        section = None
        for row, cents in zip(self.rows, self._shown_cents(), strict=True):
            if row.section != section and titles[row.section]:
                out.append(f"{titles[row.section]:<{width}} {'node-s':>10} {'USD':>12} "
                           f"{'share':>7}")
            section = row.section
            name = ("  of which " if row.section == SUBTOTAL else "  ") + row.name
            out.append(f"{name:<{width}} {_node_s(row):>10} {_usd(row, cents):>12} "
                       f"{_share(row):>7}")
            out += textwrap.wrap(_cell(row), 100, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6, max_lines=2, placeholder=" ...")
        if self.bill_usd is not None and self.productive_share is not None:
            out.append(f"\nproductive training: {self.productive_share:.1%} of the bill")
        return "\n".join(out + [f"note: {n}" for n in self.notes])

    def metadata(self) -> dict[str, float | str]:
        """Flat figures for Dagster asset metadata (floats and strings only)."""
        found: dict[str, float | str] = {"cost/engine": self.engine or "none",
                                         "cost/bill_source": self.bill_source,
                                         "cost/preemptions": float(self.preemptions)}
        if self.bill_usd is not None:
            found["cost/bill_usd"] = self.bill_usd
        for row in self.rows:
            for suffix, value in (("node_s", row.node_s), ("usd", row.usd),
                                  ("share", row.share_of_bill),
                                  ("share_of_fixed", row.share_of_fixed)):
                if value is not None:
                    found[f"cost/{row.key}_{suffix}"] = float(value)
            if row.why_missing:
                found[f"cost/{row.key}_missing"] = row.why_missing
        return found

    def _headline(self) -> str:
        if self.bill_usd is None:
            return (f"run {self.run_id}: NO BILL RECORDED, so where its dollars went is not "
                    "known; what its folder does tell:")
        billed = sum(r.node_s or 0.0 for r in self.money_rows(MARKET))
        return (f"run {self.run_id}: where every dollar went ({self.engine} engine, bill from "
                f"{self.bill_source}): {self.bill_usd:,.2f} USD for {billed:,.0f} node-s")

    def _shown_cents(self) -> list[int | None]:
        """Each row's USD in cents; in the two sections that add up to the bill, rounded so the
        shown cents add up to the shown bill (the closing row takes the rounding)."""
        shown: list[int | None] = [None if r.usd is None else round(r.usd * 100) for r in self.rows]
        if self.bill_usd is None:
            return shown
        for section in (MARKET, USE):
            index = [i for i, r in enumerate(self.rows) if r.section == section]
            if index:
                last = index[-1]
                others = sum(shown[i] or 0 for i in index[:-1])
                shown[last] = round(self.bill_usd * 100) - others
        return shown


def _node_s(row: CostRow) -> str:
    return "n/a" if row.node_s is None else f"{row.node_s:,.0f}"


def _usd(row: CostRow, cents: int | None) -> str:
    if row.section == DATA or (row.section == KNOWN and row.usd is None):
        return "-"
    if cents is None:
        return NOT_RECORDED
    # Less than a cent but not nothing: say so rather than print a 0 (it adds 0 cents).
    return "<0.01" if cents == 0 and (row.usd or 0.0) > 0 else f"{cents / 100:,.2f}"


def _share(row: CostRow) -> str:
    share = row.share_of_bill if row.share_of_fixed is None else row.share_of_fixed
    return "" if share is None else f"{share:.1%}"


def _cell(row: CostRow) -> str:
    missing = f"[{NOT_RECORDED}: {row.why_missing}]" if row.why_missing else ""
    return " ".join(part for part in (row.caused_by, missing) if part)


# -- the bill's parts, as the engines recorded them ---------------------------------------------
@dataclass
class _Part:
    node_s: float | None = 0.0
    usd: float | None = 0.0
    caused_by: str = ""
    why_missing: str = ""

    def add(self, node_s: float, usd_per_hour: float) -> None:
        self.node_s = (self.node_s or 0.0) + node_s
        self.usd = (self.usd or 0.0) + node_s * usd_per_hour / 3600.0


@dataclass
class _Bill:
    engine: str
    source: str
    bill_usd: float
    fixed_usd: float | None
    waste_node_s: float | None  # the engine's recorded preemption waste
    nodes: int
    trained_s: float
    changeover_s: float
    parts: dict[str, _Part]  # spot, on_demand, first_boot, changeovers, notice, tail, ...
    waste_keys: set[str]
    sets: list[tuple[int, float]]  # each trainer's node set, in order: (nodes, USD per hour)
    speed: float | None  # provider seconds per wall second
    speed_why: str = ""
    notes: list[str] = field(default_factory=list)
    # The supervised job's end: (wall time of the last step, wall and clock time of the end).
    tail_wall: tuple[float, float, float] | None = None
    tail_stop_s: float = math.inf  # when the last set stopped training (its notice or end)
    tail_cap_s: float = math.inf  # the last set's clock seconds after its boot


def _load(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _changeover_s(fixed_usd: float | None, on_demand_usd_per_hour: float | None, nodes: int,
                  trained_s: float) -> float:
    """The changeover the engine's fixed schedule used (fixed = on-demand x nodes x (changeover
    + trained)), so that the split uses the engine's own rule; the simulator's rule without one."""
    if fixed_usd and on_demand_usd_per_hour and math.isfinite(on_demand_usd_per_hour):
        return max(0.0, fixed_usd * 3600.0 / (on_demand_usd_per_hour * nodes) - trained_s)
    from cloud.emulated import default_rules

    return float(default_rules().changeover_s)


def _supervised(record: dict[str, Any], events: list[dict[str, Any]], source: str,
                fast: str) -> _Bill:
    figures = record["figures"]
    holdings = sorted(figures["holdings"], key=lambda h: h["launch_s"])
    nodes = int(figures.get("node_count") or record.get("nodes") or 1)
    changeover = _changeover_s(record.get("fixed_on_demand_usd"),
                               figures.get("on_demand_usd_per_hour"), nodes,
                               float(record.get("train_provider_s") or 0.0))
    parts = {k: _Part() for k in ("spot", "on_demand", "first_boot", "changeovers", "notice",
                                  "tail")}
    first_launch = holdings[0]["launch_s"] if holdings else None
    sets: dict[float, list[dict[str, Any]]] = {}
    tail_frozen = False
    for h in holdings:
        sets.setdefault(h["launch_s"], []).append(h)
        end = h["end_s"] if h.get("end_s") is not None else h["launch_s"]
        notice_at = h.get("notice_at_s")
        stop = notice_at if notice_at is not None else end
        price = float(h["price_usd_per_hour"])
        parts["spot" if h["kind"] == "spot" else "on_demand"].add(end - h["launch_s"], price)
        boot = min(changeover, max(0.0, stop - h["launch_s"]))
        parts["first_boot" if h["launch_s"] == first_launch else "changeovers"].add(boot, price)
        if notice_at is not None:
            # A set that completed with a notice: the clock froze at the last step and the tail
            # was billed as a shutdown (`freeze_after_last_step`).
            frozen = h.get("end_reason") == "completed"
            tail_frozen |= frozen
            parts["tail" if frozen else "notice"].add(max(0.0, end - notice_at), price)
    replay = record.get("replay") or {}
    speed, why = _supervised_speed(events, replay.get("seconds_per_tick")
                                   or figures.get("seconds_per_tick"))
    bill = _Bill(
        engine="supervised", source=source, bill_usd=float(record["cost_usd"]),
        fixed_usd=record.get("fixed_on_demand_usd"),
        waste_node_s=record.get("preemption_waste_node_s"), nodes=nodes,
        trained_s=float(record.get("train_provider_s") or 0.0), changeover_s=changeover,
        parts=parts, waste_keys={"changeovers", "notice", "replayed"} | (
            {"tail"} if tail_frozen else set()),
        sets=[(len(s), sum(h["price_usd_per_hour"] for h in s)) for _, s in sorted(sets.items())],
        speed=speed, speed_why=why)
    # Steps a resumed trainer re-ran: the engine measured them (at the price of the set).
    parts["replayed"] = _Part(float(figures.get("preemption_waste_s") or 0.0) * nodes,
                              float(figures.get("preemption_waste_usd") or 0.0))
    steps = int(figures.get("replayed_steps") or 0)
    parts["replayed"].caused_by = (f"{steps} step(s) re-run after resumes" if steps else
                                   "0 steps re-run: every resume started at the step its "
                                   "predecessor saved within its notice")
    if not tail_frozen:
        completed = [e for e in events if e.get("rank") == PROVIDER_RANK
                     and e["type"] == "decision" and e["action"].get("event") == "completed"]
        last_step = [e["wall_time_s"] for e in events if e["type"] == "step"]
        clock_s = (completed[-1].get("numbers") or {}).get("time_s") if completed else None
        if clock_s is not None and last_step:
            bill.tail_wall = (max(last_step), completed[-1]["wall_time_s"], float(clock_s))
        last = holdings[-1] if holdings else None
        if last is not None and last.get("end_s") is not None:
            bill.tail_stop_s = (last["notice_at_s"] if last.get("notice_at_s") is not None
                                else last["end_s"])
            bill.tail_cap_s = max(0.0, bill.tail_stop_s - last["launch_s"] - changeover)
    _supervised_causes(bill, holdings, events, record, fast)
    return bill


def _supervised_speed(events: list[dict[str, Any]], seconds_per_tick: Any
                      ) -> tuple[float | None, str]:
    """The replay clock's rate: the tick length (an allocation decision's clock time over its
    tick) over the wall seconds a tick is replayed in."""
    for e in events:
        tick = (e.get("action") or {}).get("tick") if e["type"] == "decision" else None
        time_s = (e.get("numbers") or {}).get("time_s")
        if isinstance(tick, int) and tick > 0 and time_s and seconds_per_tick:
            return float(time_s) / tick / float(seconds_per_tick), ""
    return None, "the replay's tick length is not in the telemetry's allocation decisions"


def _short(reason: str, limit: int = 60) -> str:
    reason = " ".join(str(reason).split())
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _counted(counter: Counter, examples: dict[Any, str]) -> str:
    return "; ".join(f"{n} {what} ({_short(examples[what], 48)})" if examples.get(what)
                     else f"{n} {what}" for what, n in counter.items())


def _answers(events: list[dict[str, Any]], fast_policy: str) -> str:
    """How the trainer answered its notices: counts of its preemption responses."""
    if not events:
        return "the trainer's answers are not recorded (no readable telemetry)"
    answers = Counter(str(e.get("response", "")).split(" ")[0] for e in events
                      if e["type"] == "preemption" and e.get("rank", 0) == 0)
    if not answers:
        return "no notice reached the trainer"
    said = ", ".join(f"{a} x{n}" for a, n in answers.items())
    return (f"the trainer's {sum(answers.values())} preemption event(s): {said} (fast policy "
            f"{fast_policy or 'unknown'})")


def _supervised_causes(bill: _Bill, holdings: list[dict[str, Any]],
                       events: list[dict[str, Any]], record: dict[str, Any], fast: str) -> None:
    launches: Counter = Counter()
    reasons: dict[Any, str] = {}
    for e in events:
        action = e.get("action") or {} if e["type"] == "decision" else {}
        if e.get("rank") == PROVIDER_RANK and str(action.get("applied", "")).startswith("launch"):
            market = "spot" if (action.get("spot_nodes") or 0) >= (
                action.get("on_demand_nodes") or 0) else "on-demand"
            what = f"{market} launch(es) by {e['policy']}"
            launches[what] += 1
            reasons.setdefault(what, e["reason"])
    p = bill.parts
    for key, market in (("spot", "spot"), ("on_demand", "on-demand")):
        mine = Counter({k: v for k, v in launches.items() if k.startswith(market)})
        p[key].caused_by = _counted(mine, reasons) or (
            f"no {market} held" if not p[key].node_s else
            f"{record.get('allocation_policy')}'s launches are not in the telemetry")
    kinds = Counter(h.get("end_reason") for h in holdings if h.get("notice_at_s") is not None)
    reclaims = kinds.pop("preempted", 0)
    kinds.pop("completed", None)  # the frozen tail: its own row
    late = sum(n for why, n in kinds.items() if str(why).startswith("reclaimed after"))
    moves = sum(kinds.values()) - late
    policy = record.get("allocation_policy", "the allocation policy")
    p["first_boot"].caused_by = (f"the first launch by {policy}: {bill.nodes} node(s), "
                                 f"{bill.changeover_s:.0f} s changeover each")
    p["changeovers"].caused_by = (f"{max(0, len(bill.sets) - 1)} replacement launch(es) by "
                                  f"{policy} after {reclaims} reclaim(s) and {moves} move(s)")
    p["notice"].caused_by = (f"{reclaims + moves + late} notice(s): {reclaims} reclaim(s) by "
                             f"the trace, {moves} move(s) by {policy}"
                             + (f", {late} reclaim(s) after the last step" if late else "")
                             + f"; {_answers(events, fast)}")


def _gang(record: dict[str, Any], events: list[dict[str, Any]], source: str,
          fast: str) -> _Bill:
    """The in-process engine: node times rebuilt from gang.json's launches and notices."""
    price = {n["node_id"]: (n["market"], float(n["price_usd_per_hour"]))
             for n in record.get("launched") or []}
    nodes = int(record.get("nodes") or 1)
    trained_total = float(record.get("train_provider_s") or 0.0)
    on_demand = [p for m, p in price.values() if m == "on_demand"]
    if not on_demand:
        on_demand = [_list_on_demand(record)]
    changeover = _changeover_s(record.get("fixed_on_demand_usd"), on_demand[0], nodes,
                               trained_total)
    now = float(record.get("provider_now_s") or 0.0)
    life: dict[str, list[float | None]] = {}  # node -> [launch, end]
    reclaimed: set[str] = set()
    segments: list[list[float]] = []  # training between a boot's end and the next stop
    sets: list[list[str]] = []
    current: list[str] = []
    notice: dict[str, Any] | None = None
    for h in record.get("history") or []:
        t = float(h.get("provider_time_s", 0.0))
        if h["event"] == "notice":
            notice = h
            if segments and segments[-1][1] > t:
                segments[-1][1] = t
        elif h["event"] in ("launch", "launch_failed", "gave_up"):
            if notice is not None:  # the nodes this stop released or lost
                noticed = notice.get("noticed")
                is_reclaim = str(notice.get("reason", "")).startswith("reclaim")
                gone = (noticed if is_reclaim and noticed and "replaces" in h
                        else list(current))
                for node in gone:
                    if is_reclaim and (not noticed or node in noticed):
                        reclaimed.add(node)  # billed past the notice: the bill's remainder
                    life[node][1] = float(notice["provider_time_s"])
                current = [n for n in current if n not in gone]
                notice = None
            if h["event"] != "launch":
                continue
            for node in h.get("nodes") or []:
                life[node] = [t, None]
                current.append(node)
            if sets and segments and segments[-1][0] == t + changeover:
                sets[-1] = list(current)  # one replacement of several ranks
            else:
                segments.append([t + changeover, now])
                sets.append(list(current))
    for node in current:
        if life[node][1] is None:
            life[node][1] = now
    parts = {k: _Part() for k in ("spot", "on_demand", "first_boot", "changeovers", "notice",
                                  "gang_idle")}
    first_launch = min((v[0] for v in life.values()), default=None)
    known_usd = 0.0
    for node, (launch, end) in life.items():
        market, usd_per_hour = price.get(node, ("on_demand", on_demand[0]))
        billed = max(0.0, end - launch)
        known_usd += billed * usd_per_hour / 3600.0
        parts["spot" if market == "spot" else "on_demand"].add(billed, usd_per_hour)
        boot = min(changeover, billed)
        parts["first_boot" if launch == first_launch else "changeovers"].add(boot, usd_per_hour)
        trained = sum(max(0.0, min(end, b) - max(launch, a)) for a, b in segments)
        parts["gang_idle"].add(max(0.0, billed - boot - trained), usd_per_hour)
    bill_usd = float(record["cost_usd"])
    remainder_usd = bill_usd - known_usd
    bill = _Bill(
        engine="in-process", source=source, bill_usd=bill_usd,
        fixed_usd=record.get("fixed_on_demand_usd"),
        waste_node_s=record.get("preemption_waste_node_s"), nodes=nodes,
        trained_s=trained_total, changeover_s=changeover, parts=parts,
        waste_keys={"changeovers", "notice", "gang_idle"},
        sets=[(len(s), sum(price.get(n, ("", on_demand[0]))[1] for n in s)) for s in sets],
        speed=None)
    _gang_notice(bill, remainder_usd, {price.get(n, ("", 0.0)) for n in reclaimed})
    _gang_speed(bill, record)
    if abs(sum(max(0.0, b - a) for a, b in segments) - trained_total) > 1.0:
        bill.notes.append(f"the training segments rebuilt from {GANG_FILE}'s history differ "
                          f"from its train_provider_s ({trained_total:,.0f} s)")
    _gang_causes(bill, record, events, fast)
    if record.get("provider") != "emulated":  # a real provider's boot is its pending time
        for key in ("first_boot", "changeovers", "gang_idle"):
            parts[key].node_s = parts[key].usd = None
            parts[key].why_missing = (f"the {record.get('provider')} provider's boot times are "
                                      f"not in {GANG_FILE}")
    return bill


def _list_on_demand(record: dict[str, Any]) -> float:
    from cloud.providers.base import node_price_usd_per_hour

    try:
        return node_price_usd_per_hour(record["provider"], record["instance_type"],
                                       record["zone"], "on_demand")
    except (ValueError, KeyError):  # unknown type or zone: the fixed schedule has no price
        return math.nan


def _gang_notice(bill: _Bill, remainder_usd: float, prices: set[tuple[str, float]]) -> None:
    """A reclaimed node is billed from its notice until it is down (at most the notice), a time
    gang.json does not keep: the bill's remainder over the timed node-seconds is that time."""
    part, spot, on_demand = bill.parts["notice"], bill.parts["spot"], bill.parts["on_demand"]
    if remainder_usd < -0.005:
        bill.notes.append(f"the bill is {-remainder_usd:.2f} USD below the node times in "
                          f"{GANG_FILE}'s history")
    remainder_usd = max(0.0, remainder_usd)
    part.usd = remainder_usd
    if not prices or remainder_usd == 0.0:
        part.node_s = part.usd = 0.0
        if remainder_usd >= 0.005:  # no reclaim explains it: kept apart, never guessed
            bill.parts["unattributed"] = _Part(
                None, remainder_usd, "the bill beyond the node times in the history",
                "no reclaim in the history explains it")
        return
    if len(prices) == 1:
        (market, usd_per_hour), = prices
        part.node_s = remainder_usd * 3600.0 / usd_per_hour
        target = spot if market == "spot" else on_demand
        target.node_s = (target.node_s or 0.0) + part.node_s
        target.usd = (target.usd or 0.0) + remainder_usd
        return
    part.node_s = spot.node_s = None
    part.why_missing = spot.why_missing = (
        "reclaimed nodes at different prices: their seconds after the notice cannot be told "
        "apart from the bill")
    spot.usd = (spot.usd or 0.0) + remainder_usd  # a reclaim is always of a spot node


def _gang_speed(bill: _Bill, record: dict[str, Any]) -> None:
    """Provider seconds per wall second: 1 on a real provider; on the emulated one the tick
    length (a notice's clock time over its trace tick) over the replay's seconds per tick."""
    replay = record.get("replay")
    if record.get("provider") != "emulated":
        bill.speed = 1.0
        return
    for h in record.get("history") or []:
        found = re.search(r"at trace tick (\d+)", str(h.get("reason", "")))
        if h["event"] == "notice" and found and replay:
            ticks = int(found.group(1)) - int(replay.get("window_start_tick") or 0)
            if ticks > 0 and h.get("provider_time_s"):
                bill.speed = float(h["provider_time_s"]) / ticks / float(
                    replay["seconds_per_tick"])
                return
    bill.speed_why = (f"{GANG_FILE} does not give the replay's tick length (no reclaim notice "
                      "names its trace tick)")


def _gang_causes(bill: _Bill, record: dict[str, Any], events: list[dict[str, Any]],
                 fast: str) -> None:
    history = record.get("history") or []
    launches = [h for h in history if h["event"] == "launch"]
    why = {"request": "the train request", "slow_policy": "the slow policy's allocation",
           "fallback": "fallback: spot refused", "default": "the default allocation"}
    p = bill.parts
    for key, market in (("spot", "spot"), ("on_demand", "on_demand")):
        mine = Counter(why.get(h.get("source"), h.get("source") or "?") for h in launches
                       if h.get("market") == market)
        p[key].caused_by = "; ".join(f"{n} launch(es): {w}" for w, n in mine.items()) or (
            f"no {market.replace('_', '-')} held")
    stops = [h for h in history if h["event"] == "notice"]
    reclaims = sum(str(h.get("reason", "")).startswith("reclaim") for h in stops)
    moves = len(stops) - reclaims
    p["first_boot"].caused_by = (f"the first launch ({_short(launches[0]['reason'], 70)})"
                                 if launches else "no launch recorded")
    p["changeovers"].caused_by = (f"{max(0, len(launches) - 1)} replacement launch(es) after "
                                  f"{reclaims} reclaim(s) and {moves} move(s) by the slow policy")
    p["notice"].caused_by = (f"{len(stops)} notice(s) ({reclaims} reclaim(s), {moves} move(s)); "
                             f"{_answers(events, fast)}")
    p["gang_idle"].caused_by = ("kept nodes billed while a rank's replacement booted"
                                if bill.nodes > 1 else "one node: never waits for another")


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
        keys = ["checkpoint", "straggler"] + (["replayed"] if bill.engine == "in-process" else [])
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

    if bill.engine == "in-process":  # re-run steps are training time on this engine
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
