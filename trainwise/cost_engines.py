"""The provider's bill of one run, split as each engine recorded it (`trainwise.cost_summary`).

`_supervised` reads `supervised.json` (every node's launch, notice and end in
`figures.holdings`); `_gang` reads `gang.json` (launches and notices in `history`, the bill, the
seconds trained; a reclaimed node's minutes after its notice are the bill's remainder over the
timed node-seconds). Both return a `_Bill` of named `_Part`s with the decisions that caused each.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwise.cost_rows import GANG_FILE, PROVIDER_RANK


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
        engine="node-agent" if record.get("runs_on") == "node agents" else "in-process",
        source=source, bill_usd=bill_usd,
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

