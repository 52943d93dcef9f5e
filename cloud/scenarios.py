"""Scenarios: the job shapes (settings) and real-trace windows policies are scored on.

The cost suite (`benchmarks/cost`) runs every policy and the hindsight oracle on them; the
learned policies (`rl/cells.py`) train and are gated on them. They live here, not in the
benchmarks, so the product never imports `benchmarks` (issue 25).

Settings (each a job shape on some trace folders):
- `single_node`: the job shape of Can't Be Late (Wu et al., NSDI'24): 1 node, 48 h of training, a
  52 h deadline, 0.1 h changeover; on p3.2xlarge traces on-demand 3.06 USD/h and spot 0.9731 USD/h
  as in the paper, unless the data states its own (collection.toml, or spot prices recorded in
  the trace file: those are billed, `trace_prices`). Not that paper's exact setting (this one
  saves checkpoints; see `benchmarks/cant_be_late`). The same job runs on every 1-node trace
  folder; the K80 and 8-GPU traces of the 2022-10 folder price their own instance type (list
  price, spot from the Spot Advisor saving) and are reported as cells of their own, never pooled
  with other prices.
- `gang_4node`: 4 x p3.2xlarge in one synchronous gang, 160 GPU-h of work, a 52 h deadline, on
  the REAL 4-node market as recorded (values 0..4 per zone).
- `multi_node`: 16 x p3.2xlarge in one synchronous gang, 640 GPU-h of work, a 52 h deadline, on
  a SYNTHETIC market: the 4-node trace scaled to 16 nodes as 4 pools: the zone's availability at
  tick i is the sum of the 4-node trace at ticks i, i+1 d, i+2 d, i+3 d (`scaled_availability`).
  Its scenarios' folder reads "synthetic: ..." in every table. A collection that records
  `node_count` nodes per file is used as recorded instead; any other cluster size is refused.
  Never a headline, never pooled with a real market. Stragglers (mean slowest-of-N inflation from
  the Alibaba traces) are on in both gang settings; node faults (from the InfiniteHBD fault log,
  seeded per scenario, no notice: the work since the last checkpoint is lost) in every setting.

All settings share the rules: checkpoint save 60 s every hour of training (trainwise, which
chooses its interval, saves a single node at Daly's interval for faults: a save fits the notice),
120 s spot notice (a save fits it), per-second billing.

Two scenario kinds, each with its own oracle:
- single-zone: one trace file, one window; the job stays in that zone;
- multi-zone: the zones of one folder with the same node shape, one window, a home zone (each
  zone in turn): single-zone policies stay home, failover policies may move, paying a changeover.
Windows per zone are evenly spaced start ticks over the trace (leave-one-collection-out) or over
its later part (leave-time-out); `cloud/scenario_protocol.py` says what trainwise's risk model is
fitted on. A collection too short for a setting's window is skipped for that setting with a
reason naming the collection, its shortest file, the setting and the lengths (`SkippedCell`);
the other collections are scored.

Which collections and settings are scored: `discovered_settings` (every collection in the spot
data folder by its recorded cluster size, or a chosen subset, or every collection that can hold a
chosen gang size).
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from cloud.collections import COLLECTION_FILE, read_collection
from cloud.policy_registry import make_policy
from cloud.prices import (
    CANT_BE_LATE_ON_DEMAND_USD_PER_HOUR,
    CANT_BE_LATE_SPOT_USD_PER_HOUR,
)
from cloud.risk_fit import AvailabilityHistory, folder_histories
from cloud.scenario_protocol import (
    LOCO,
    LTO,
    LTO_FIT_SHARE,
    PROTOCOLS,
    FitSplit,
    at_window_start,
    fit_for_split,
    loco_split,
    lto_split,
    lto_split_tick,
)
from cloud.simulator import ClusterRules, JobSpec, Market, market_from_traces
from cloud.stragglers import StragglerSampler, load_step_inflation
from cloud.traces import (
    SpotTrace,
    default_spot_dir,
    group_by_shape,
    load_folder,
    scaled_availability,
)
from controllers.preemption_risk import PreemptionRiskModel

SINGLE_NODE_FOLDERS = (
    "availability-1node-aws-2023-02",
    "availability-1node-aws-2022-10",
    "preemption-1node-aws-2023-04",
)
MULTI_NODE_FOLDER = "preemption-4node-aws-2023-08"


@dataclass(frozen=True)
class Setting:
    name: str
    title: str
    folders: tuple[str, ...]
    node_count: int
    # Hours of full-gang training at the reference throughput (before stragglers).
    train_h: float
    deadline_h: float
    changeover_s: float = 360.0
    checkpoint_save_s: float = 60.0
    checkpoint_interval_s: float = 3600.0
    notice_s: float = 120.0
    # A SYNTHETIC market for a gang larger than the recorded cluster: `copies` copies of a trace
    # recording node_count / copies nodes, shifted by `copy_offset_s` each. Not used on a
    # collection that records node_count nodes itself (that one runs as recorded).
    copies: int = 1
    copy_offset_s: int = 0
    stragglers: bool = False
    faults: bool = False

    @property
    def synthetic(self) -> bool:
        """Its market is built from shifted copies, not recorded: labelled, never a headline."""
        return self.copies > 1

    def job(self, gpus_per_node: int, deadline_h: float | None = None) -> JobSpec:
        """The job on nodes of `gpus_per_node` GPUs; a CPU node (0 GPUs) counts as one unit, so
        its work is node-hours at the same train_h."""
        units = max(gpus_per_node, 1)
        return JobSpec(
            work_gpu_h=self.train_h * self.node_count * units,
            deadline_s=(deadline_h if deadline_h is not None else self.deadline_h) * 3600.0,
            node_count=self.node_count,
            gpus_per_node=units,
        )


SINGLE_NODE = Setting(
    name="single_node",
    title="1 node, 48 h of work, 52 h deadline, 0.1 h changeover, 60 s hourly saves (the job "
    "shape of Can't Be Late, not its exact setting)",
    folders=SINGLE_NODE_FOLDERS,
    node_count=1,
    train_h=48.0,
    deadline_h=52.0,
    # Node faults for every policy: trainwise saves for faults only when the notice covers a
    # reclaim (`fault_checkpoint_interval`), so their risk must be in the bill.
    faults=True,
)
MULTI_NODE = Setting(
    name="multi_node",
    title="SYNTHETIC market: 16 x p3.2xlarge gang, 640 GPU-h of work, 52 h deadline (4-node "
    "trace x 4 pools shifted 1 d)",
    folders=(MULTI_NODE_FOLDER,),
    node_count=16,
    train_h=40.0,
    deadline_h=52.0,
    copies=4,
    copy_offset_s=86400,
    stragglers=True,
    faults=True,
)
GANG_4NODE = Setting(
    name="gang_4node",
    title="4 x p3.2xlarge gang on the real 4-node market as recorded, 160 GPU-h of work, 52 h "
    "deadline",
    folders=(MULTI_NODE_FOLDER,),
    node_count=4,
    train_h=40.0,
    deadline_h=52.0,
    stragglers=True,
    faults=True,
)
SETTINGS = (SINGLE_NODE, GANG_4NODE, MULTI_NODE)
# Issue 9's thin-slack case: a short gang job at the suite's slack ratio (52 / 40 = 5.2 / 4),
# where one wasted changeover is a large share of the slack and of the bill. Reported apart.
SHORT_GANG_4NODE = replace(
    GANG_4NODE,
    name="gang_4node_short",
    title="4 x p3.2xlarge gang on the real 4-node market as recorded, 16 GPU-h of work (4 h), "
    "5.2 h deadline (the suite's slack ratio)",
    train_h=4.0,
    deadline_h=5.2,
)
SHORT_SETTINGS = (SHORT_GANG_4NODE,)
# Short windows are cheap: this many times the suite's start windows per zone.
SHORT_WINDOWS_FACTOR = 3


def gang_setting(nodes: int) -> Setting:
    """The real-gang setting of `nodes` nodes: the 4-node gang's job shape (40 h of full-gang
    training, 52 h deadline), on collections recording at least `nodes` nodes, as recorded."""
    if nodes == GANG_4NODE.node_count:
        return GANG_4NODE
    return replace(GANG_4NODE, name=f"gang_{nodes}node", node_count=nodes, folders=(),
                   title=f"{nodes}-node gang on real markets of {nodes} or more nodes as "
                   "recorded, 40 h of full-gang training, 52 h deadline")


def _by_suite_order(collections: Iterable[str]) -> list[str]:
    known = {folder: i for i, folder in enumerate(SINGLE_NODE_FOLDERS)}
    return sorted(collections, key=lambda c: (known.get(c, len(known)), c))


def settings_for(
    nodes_by_collection: dict[str, int], gang_size: int | None = None
) -> tuple[Setting, ...]:
    """The suite's settings over these collections (name -> nodes per file): every 1-node
    collection in the single-node setting, every N-node one (N > 1) in the N-node gang setting
    as recorded, and the SYNTHETIC 16-node market where its 4-node source is present. So a
    collection a user adds (with its collection.toml) is scored, not only used as a prior.

    With `gang_size` G: one setting only, the G-node job (the single-node one for G = 1, else
    `gang_setting(G)`) on every collection recording at least G nodes (a 4-node collection can
    be scored as a 1- or 2-node job); smaller collections are left out (`too_small_for`)."""
    if gang_size is not None:
        if gang_size < 1:
            raise ValueError(f"gang_size={gang_size} must be at least 1")
        fits = _by_suite_order(c for c, n in nodes_by_collection.items() if n >= gang_size)
        base = SINGLE_NODE if gang_size == 1 else gang_setting(gang_size)
        return (replace(base, folders=tuple(fits)),) if fits else ()
    single = _by_suite_order(c for c, n in nodes_by_collection.items() if n == 1)
    out = [replace(SINGLE_NODE, folders=tuple(single))] if single else []
    gangs: dict[int, list[str]] = {}
    for collection, nodes in nodes_by_collection.items():
        if nodes > 1:
            gangs.setdefault(nodes, []).append(collection)
    out += [replace(gang_setting(n), folders=tuple(sorted(gangs[n]))) for n in sorted(gangs)]
    if MULTI_NODE_FOLDER in gangs.get(MULTI_NODE.node_count // MULTI_NODE.copies, ()):
        out.append(MULTI_NODE)
    return tuple(out)


def short_settings(settings: Iterable[Setting]) -> tuple[Setting, ...]:
    """The short job (4 h of work, 5.2 h deadline) of every real gang setting."""
    out = []
    for s in settings:
        if s.node_count == 1 or s.synthetic:
            continue
        base = SHORT_GANG_4NODE if s.node_count == GANG_4NODE.node_count else replace(
            s, name=f"{s.name}_short", train_h=SHORT_GANG_4NODE.train_h,
            deadline_h=SHORT_GANG_4NODE.deadline_h,
            title=f"{s.title.split(',')[0]}, 4 h of work, 5.2 h deadline (the suite's slack "
            "ratio)")
        out.append(replace(base, folders=s.folders))
    return tuple(out)


def too_small_for(nodes_by_collection: dict[str, int], gang_size: int) -> dict[str, str]:
    """Collection -> why `settings_for(..., gang_size)` leaves it out (it records fewer nodes)."""
    return {c: f"{c} records {n}-node markets, fewer than the {gang_size}-node gang asked for; "
               "a spot gang could never run there"
            for c, n in sorted(nodes_by_collection.items()) if n < gang_size}


def collection_nodes(name: str) -> int:
    """Nodes of the market a collection in the spot data folder loads as (its collection.toml:
    nodes_per_file, or 1 where up_if_at_least makes each file one node of several VMs)."""
    return read_collection(default_spot_dir() / name).market_nodes


def discovered_settings(
    collections: Iterable[str] | None = None, gang_size: int | None = None
) -> tuple[Setting, ...]:
    """`settings_for` every collection in the spot data folder, or only `collections` (folder
    names there; an unknown one is refused, naming the known ones)."""
    return settings_for(collection_nodes_of(collections), gang_size)


def collection_nodes_of(collections: Iterable[str] | None = None) -> dict[str, int]:
    """Name -> market nodes of every collection in the spot data folder, or of `collections`."""
    known = all_collections()
    chosen = known if collections is None else tuple(collections)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise ValueError(
            f"no collection {unknown[0]!r} in {default_spot_dir()} (a folder with a "
            f"{COLLECTION_FILE}); collections there: {', '.join(known) or 'none'}"
        )
    return {name: collection_nodes(name) for name in chosen}


def setting_of(collection: str) -> Setting:
    """The discovered setting that scores `collection` as recorded (single node or its gang)."""
    nodes = collection_nodes(collection)
    return SINGLE_NODE if nodes == 1 else gang_setting(nodes)


@dataclass
class Scenario:
    setting: Setting
    kind: str  # "single_zone" | "multi_zone"
    folder: str
    instance_type: str
    market: Market  # the window
    home_zone: str
    start_tick: int
    job: JobSpec
    rules: ClusterRules
    oracle_key: tuple  # scenarios with the same key share one oracle
    seed: int
    deadline_h: float
    # The collection the market comes from (`folder` is the label tables show: "synthetic: ..."
    # for a synthetic market); the risk model's prior leaves this one out.
    source_folder: str = ""
    # The whole market the window was cut from (all zones of the folder and node shape): policies
    # that learn from history may read what `fit_split` allows, and the runs in progress at
    # `start_tick` (see `risk_model_for`).
    trace_market: Market | None = None
    # What trainwise's risk model is fitted on for this window (protocol.py).
    fit_split: FitSplit | None = None
    window_ticks: int = 0

    @property
    def protocol(self) -> str:
        return self.fit_split.protocol if self.fit_split else "in_sample"


@dataclass
class ZoneGroup:
    """Zones of one folder with one node shape, already scaled, as one market over the trace."""

    folder: str
    instance_type: str
    gpus_per_node: int
    market: Market
    # What tables call it: the folder, or "synthetic: ..." for a synthetic market.
    label: str = ""
    # (file name, ticks) of each zone's trace, for reasons that name them.
    files: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class SkippedCell:
    """Cells of a setting not scored on a collection, and why (`build_scenarios`)."""

    setting: str
    protocol: str
    folder: str
    instance_type: str
    reason: str


class SkippedCellWarning(UserWarning):
    """A collection too short for a setting's window: its cells are skipped, the others run."""


def trace_prices(trace: SpotTrace) -> tuple[float, float]:
    """(spot, on-demand) USD per node-hour: each price the data states (collection.toml; for
    spot also the prices recorded in the trace file) is billed; a price looked up is the paper's
    on p3.2xlarge, else the loader's list price and Spot Advisor saving for the zone's region."""
    paper = trace.instance_type == "p3.2xlarge"
    spot = (trace.spot_usd_per_hour if trace.spot_price_stated or not paper
            else CANT_BE_LATE_SPOT_USD_PER_HOUR)
    on_demand = (trace.on_demand_usd_per_hour
                 if trace.on_demand_price_source == COLLECTION_FILE or not paper
                 else CANT_BE_LATE_ON_DEMAND_USD_PER_HOUR)
    return spot, on_demand


def gang_market(
    setting: Setting, folder: str, traces: list[SpotTrace]
) -> tuple[list[np.ndarray] | None, str]:
    """(availability replacing the traces' own, or None; the label) for `setting`'s gang.

    A collection recording at least `node_count` nodes is used as recorded. A smaller one is
    scaled only when the setting says how (copies x recorded nodes = node_count), and labelled
    synthetic; anything else is refused rather than summed into a market of another size.
    """
    recorded = max(t.capacity_nodes for t in traces)
    if setting.copies == 1 or recorded == setting.node_count:
        if recorded < setting.node_count:
            raise ValueError(
                f"{folder} records {recorded}-node markets, but setting {setting.name!r} runs a "
                f"{setting.node_count}-node gang, which spot could never hold there; use a "
                f"collection with nodes_per_file >= {setting.node_count}, or set copies for a "
                "labelled synthetic market"
            )
        return None, folder
    if recorded * setting.copies != setting.node_count:
        raise ValueError(
            f"setting {setting.name!r} builds a synthetic {setting.node_count}-node market from "
            f"{setting.copies} copies of a {setting.node_count // setting.copies}-node trace, but "
            f"{folder} records {recorded}-node markets ({setting.copies} x {recorded} = "
            f"{setting.copies * recorded} nodes); use copies=1 to run a {setting.node_count}-node "
            "collection as recorded, or a collection of the size the copies expect"
        )
    offset = setting.copy_offset_s // traces[0].tick_s
    availability = [scaled_availability(t.available, setting.copies, offset) for t in traces]
    label = (
        f"synthetic: {setting.copies} x {folder} shifted {setting.copy_offset_s / 86400:g} d"
    )
    return availability, label


def zone_groups(setting: Setting, max_zones: int | None = None) -> list[ZoneGroup]:
    groups: list[ZoneGroup] = []
    for folder in setting.folders:
        for traces in group_by_shape(load_folder(folder)).values():
            traces = traces[:max_zones] if max_zones else traces
            prices = [trace_prices(t) for t in traces]
            availability, label = gang_market(setting, folder, traces)
            market = market_from_traces(
                traces, tuple(p[0] for p in prices), tuple(p[1] for p in prices), availability
            )
            first = traces[0]
            groups.append(
                ZoneGroup(folder, first.instance_type, first.gpus_per_node, market, label,
                          tuple((Path(t.source_path).name, t.n_ticks) for t in traces))
            )
    return groups


def window_starts(n_ticks: int, window_ticks: int, count: int) -> list[int]:
    """`count` evenly spaced start ticks of windows that fit the trace."""
    last = n_ticks - window_ticks
    if last < 0:
        raise ValueError(
            f"a window of {window_ticks} ticks does not fit a trace of {n_ticks} ticks"
        )
    if count <= 1 or last == 0:
        return [0]
    return sorted({round(x) for x in np.linspace(0, last, count)})


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def build_scenarios(
    setting: Setting,
    rules: ClusterRules,
    windows_per_zone: int,
    kinds: Iterable[str] = ("single_zone", "multi_zone"),
    deadline_h: float | None = None,
    max_zones: int | None = None,
    folders: tuple[str, ...] | None = None,
    starts_deadline_h: float | None = None,
    protocol: str = LOCO,
    skipped: list[SkippedCell] | None = None,
    starts_for: Callable[[ZoneGroup, int], Iterable[int]] | None = None,
) -> list[Scenario]:
    """Scenarios of `setting` under `protocol` (LOCO: windows over the whole trace, each scored
    with a model fitted on the other collections; LTO: windows after the split tick only, the
    model fitted on the ticks before it). `starts_deadline_h` places the windows as if the
    deadline were that long, so a sweep over deadlines starts every deadline's windows at the
    same ticks.

    A collection's market too short for the window is skipped with its reason: appended to
    `skipped` when given, else warned (`SkippedCellWarning`); the other collections run.

    `starts_for(group, window_ticks)`, LOCO only, replaces the evenly spaced start ticks of a
    zone group's windows (retraining places its windows by real time: `rl.training_data`)."""
    deadline_h = deadline_h if deadline_h is not None else setting.deadline_h
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} must be one of {PROTOCOLS}")
    if protocol == LTO and setting.synthetic:
        # Synthetic tick i sums raw ticks up to i + (copies - 1) offsets: a time split of it
        # would let the fit read raw hours the scored windows also use.
        raise ValueError(f"setting {setting.name!r} is a synthetic market; leave-time-out "
                         "cannot split it without leaking; use leave-one-collection-out")
    if starts_for is not None and protocol != LOCO:
        raise ValueError("starts_for places windows under leave-one-collection-out only; "
                         "leave-time-out places them after its split tick")
    if folders is not None:
        setting = replace(setting, folders=folders)
    collections = all_collections()
    scenarios: list[Scenario] = []
    for group in zone_groups(setting, max_zones):
        job = setting.job(group.gpus_per_node, deadline_h)
        window_ticks = math.floor(job.deadline_s / group.market.tick_s + 1e-9)
        starts_ticks = window_ticks
        if starts_deadline_h is not None:
            starts_ticks = max(
                window_ticks, math.floor(starts_deadline_h * 3600 / group.market.tick_s)
            )
        short = _too_short(setting, protocol, group, starts_ticks)
        if short is not None:
            cell = SkippedCell(setting.name, protocol, group.folder, group.instance_type, short)
            if skipped is None:
                warnings.warn(short, SkippedCellWarning, stacklevel=2)
            else:
                skipped.append(cell)
            continue
        if protocol == LOCO:
            split = loco_split(group.folder, collections)
            starts = (window_starts(group.market.n_ticks, starts_ticks, windows_per_zone)
                      if starts_for is None else _checked_starts(group, starts_for, starts_ticks))
        else:
            first = lto_split_tick(group.market.n_ticks, starts_ticks)
            split = lto_split(group.folder, first)
            starts = [first + s for s in window_starts(
                group.market.n_ticks - first, starts_ticks, windows_per_zone)]
        # Identifies the scenario family in oracle keys and seeds.
        key = (setting.name, deadline_h, group.folder, group.instance_type)
        for start in starts:
            window = group.market.window(start, window_ticks)
            for zone in window.zones:
                base = {
                    "setting": setting,
                    "folder": group.label or group.folder,
                    "source_folder": group.folder,
                    "instance_type": group.instance_type,
                    "home_zone": zone,
                    "start_tick": start,
                    "job": job,
                    "rules": rules,
                    "deadline_h": deadline_h,
                    "trace_market": group.market,
                    "fit_split": split,
                    "window_ticks": window_ticks,
                }
                if "single_zone" in kinds:
                    scenarios.append(
                        Scenario(
                            kind="single_zone",
                            market=window.zone_market(zone),
                            oracle_key=(*key, zone, start),
                            seed=_seed(*key, zone, start),
                            **base,
                        )
                    )
                if "multi_zone" in kinds and len(window.zones) > 1:
                    scenarios.append(
                        Scenario(
                            kind="multi_zone",
                            market=window,
                            oracle_key=(*key, window.zones, start),
                            seed=_seed(*key, zone, start, "multi"),
                            **base,
                        )
                    )
    return scenarios


def _checked_starts(group: ZoneGroup, starts_for: Callable[[ZoneGroup, int], Iterable[int]],
                    window_ticks: int) -> list[int]:
    """`starts_for`'s start ticks, refused (naming the group) when a window would not fit."""
    starts = sorted({int(s) for s in starts_for(group, window_ticks)})
    bad = [s for s in starts if s < 0 or s + window_ticks > group.market.n_ticks]
    if bad:
        raise ValueError(f"start tick {bad[0]} of {group.folder} ({group.instance_type}): a "
                         f"window of {window_ticks} ticks does not fit its "
                         f"{group.market.n_ticks} ticks")
    return starts


def _too_short(setting: Setting, protocol: str, group: ZoneGroup, window_ticks: int
               ) -> str | None:
    """Why `group`'s market cannot hold a window of `setting` under `protocol`, or None."""
    n_ticks = group.market.n_ticks
    if protocol == LOCO:
        if n_ticks >= window_ticks:
            return None
        need = f"a window of {window_ticks} ticks"
    else:
        try:
            lto_split_tick(n_ticks, window_ticks)
            return None
        except ValueError:
            need = (f"a window of {window_ticks} ticks after the leave-time-out fit's first "
                    f"{int(n_ticks * LTO_FIT_SHARE)} ticks")
    hours = window_ticks * group.market.tick_s / 3600
    shortest = min(group.files, key=lambda f: f[1]) if group.files else None
    files = (f"its shortest file {shortest[0]} holds {shortest[1]} ticks" if shortest
             else "no file named")
    synthetic = f" (market {group.label})" if group.label and group.label != group.folder else ""
    return (
        f"skipped {group.folder} ({group.instance_type}) for setting {setting.name!r} under "
        f"{protocol}: it needs {need} ({hours:g} h at {group.market.tick_s} s a tick), but the "
        f"market of its zones{synthetic} holds {n_ticks} ticks ({files}; zones are paired over "
        "their common length); the other collections are scored"
    )


def rules_for(setting: Setting) -> ClusterRules:
    slowdown = 1.0
    if setting.stragglers:
        sampler = StragglerSampler(load_step_inflation(), seed=0)
        slowdown = sampler.expected_step_slowdown(setting.node_count)
    return ClusterRules(
        changeover_s=setting.changeover_s,
        checkpoint_save_s=setting.checkpoint_save_s,
        checkpoint_interval_s=setting.checkpoint_interval_s,
        notice_s=setting.notice_s,
        step_slowdown=slowdown,
    )



def risk_model_for(scenario: Scenario) -> PreemptionRiskModel:
    """The hazard model trainwise_heuristic gets for a scenario: fitted once per split and market
    on what `scenario.fit_split` allows (protocol.py), then given the runs in progress at the
    window's start."""
    market = scenario.trace_market
    if market is None or scenario.fit_split is None:
        raise ValueError("scenario has no trace_market or fit_split to fit a risk model on; "
                         "build it with build_scenarios")
    key = (scenario.setting.name, scenario.folder, scenario.instance_type, scenario.fit_split)
    if key not in _RISK_MODELS:
        _RISK_MODELS[key] = fit_for_split(
            scenario.fit_split, market, f"{scenario.folder}/{scenario.instance_type}",
            cached_folder_histories,
        )
    # One object per window, so every caller of a window (the policy, a test) shares it.
    window_key = (*key, scenario.start_tick)
    if window_key not in _WINDOW_MODELS:
        _WINDOW_MODELS[window_key] = at_window_start(_RISK_MODELS[key], market,
                                                     scenario.start_tick)
    return _WINDOW_MODELS[window_key]


_RISK_MODELS: dict[tuple, PreemptionRiskModel] = {}
_WINDOW_MODELS: dict[tuple, PreemptionRiskModel] = {}


def all_collections() -> tuple[str, ...]:
    """Every collection (folder with a collection.toml) in the spot data folder: the pool a
    leave-one-collection-out fit draws the other collections from."""
    return tuple(sorted(p.parent.name for p in default_spot_dir().glob(f"*/{COLLECTION_FILE}")))


@functools.cache
def cached_folder_histories(folder: str) -> tuple[AvailabilityHistory, ...]:
    return tuple(folder_histories(folder))


def forget_loaded_data() -> None:
    """Drops what this module cached from the spot data folder (folder histories, fitted risk
    models): they are keyed by folder name, so a long-lived process whose data grew (a newer
    collection, a longer trace, another TRAINWISE_DATA_DIR) would otherwise keep fitting on the
    old data. `rl.training_data` calls it when the folder's files change."""
    cached_folder_histories.cache_clear()
    _RISK_MODELS.clear()
    _WINDOW_MODELS.clear()


# Policies whose factory takes per-scenario arguments: name -> kwargs builder.
SCENARIO_POLICY_KWARGS: dict[str, Callable[[Scenario], dict[str, Any]]] = {
    "trainwise_heuristic": lambda scenario: {"risk_model": risk_model_for(scenario)},
}


def policy_for(name: str, scenario: Scenario) -> Any:
    """A fresh policy for one scenario (per-scenario arguments from SCENARIO_POLICY_KWARGS)."""
    builder = SCENARIO_POLICY_KWARGS.get(name)
    return make_policy(name, **(builder(scenario) if builder else {}))

