"""Nothing billed runs idle (issue 27): nodes on aws (and pods on kubernetes: the label
`trainwise/run`, `cloud.providers.kubernetes_pods.PodSweep`) that no live run of this
deployment holds.

When the code location's process dies mid-run (a restart, a crash, kill -9), the nodes its
in-process engine launched keep running and keep billing. This module finds them by their tag
(`trainwise:node`, `AwsProvider.tagged_instances`) and says, for each, whose it is and why it is
an orphan; `pipelines/jobs.py`'s `terminate_orphan_nodes` job terminates them as a recorded run,
and `sensors/orphan_nodes.py` asks for that run (its first tick comes right after the daemon
starts, so after a restart of the code location).

Whose node: a run of this deployment (a folder under `<TRAINWISE_HOME>/runs`) holds a node when
its `gang.json` lists the node among what its provider launched, or the node's `trainwise:run`
tag names it. Such a node is an orphan when its run

- has ended: the run wrote its `outcome.json`, so it released its nodes, and any still up were
  left behind (a termination that failed, a crash after the outcome);
- or is dead: no process holds the run folder's lock (the trainer holds it while it trains;
  read from the kernel, nothing is taken) and `gang.json` was last written more than
  `GRACE_S` ago (boot, restore and relaunch write it, with the lock not yet held).

A tagged node that no run of this deployment names is `unknown`: another deployment's, or this
one's after its state folder was lost. It is listed, not terminated, unless the job is told to
(`terminate_unknown`): the tag alone does not say it is ours.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.run_lock import lock_holder
from trainwise.gang import GANG_FILE
from trainwise.runs import OUTCOME_NAME

# gang.json is rewritten at every launch, boot, notice and restore: a run whose file is younger
# than this may be between two segments (its trainer not yet holding the lock).
GRACE_S = 900.0


@dataclass(frozen=True)
class Orphan:
    instance_id: str
    zone: str
    instance_type: str
    launched_at_s: float
    run_id: str  # the run of this deployment that launched it; "" when unknown
    why: str

    @property
    def unknown(self) -> bool:
        return not self.run_id


@dataclass(frozen=True)
class _RunState:
    live: bool
    why: str  # why it is not live (ended, dead), or what keeps it live
    node_ids: frozenset[str]


def _run_state(run_dir: Path, now_wall_s: float, grace_s: float) -> _RunState:
    gang_path = run_dir / GANG_FILE
    try:
        record = json.loads(gang_path.read_text(encoding="utf-8"))
        written_s = gang_path.stat().st_mtime
    except (OSError, ValueError):
        record, written_s = {}, None
    node_ids = frozenset(str(n.get("node_id")) for n in (record.get("launched") or [])
                         if isinstance(n, dict) and n.get("node_id"))
    outcome_path = run_dir / OUTCOME_NAME
    if outcome_path.exists():
        try:
            status = json.loads(outcome_path.read_text(encoding="utf-8")).get("status", "?")
        except (OSError, ValueError, AttributeError):
            status = "unreadable"
        return _RunState(False, f"its run ended ({OUTCOME_NAME}: {status})", node_ids)
    holder = lock_holder(run_dir)
    if holder:
        return _RunState(True, f"its trainer (pid {holder.get('pid')}) holds the run", node_ids)
    if written_s is not None and now_wall_s - written_s < grace_s:
        return _RunState(True, f"{GANG_FILE} written {now_wall_s - written_s:.0f} s ago",
                         node_ids)
    age = (f"{GANG_FILE} last written {(now_wall_s - written_s) / 60:.0f} min ago"
           if written_s is not None else f"no {GANG_FILE}")
    return _RunState(False, f"its run is dead (no process holds the run folder; {age})",
                     node_ids)


def run_states(state_dir: Path, now_wall_s: float, grace_s: float = GRACE_S
               ) -> dict[str, _RunState]:
    runs = Path(state_dir) / "runs"
    if not runs.is_dir():
        return {}
    return {d.name: _run_state(d, now_wall_s, grace_s) for d in sorted(runs.iterdir())
            if d.is_dir()}


def find_orphans(provider: Any, state_dir: Path, *, now_wall_s: float | None = None,
                 grace_s: float = GRACE_S) -> list[Orphan]:
    """The tagged pending or running instances no live run of this deployment holds (read
    only: one paged describe_instances call and the run folders)."""
    now = time.time() if now_wall_s is None else now_wall_s
    states = run_states(state_dir, now, grace_s)
    owner_of = {node: run_id for run_id, st in states.items() for node in st.node_ids}
    orphans = []
    for instance in provider.tagged_instances():
        run_id = owner_of.get(instance.instance_id) or (
            instance.run_id if instance.run_id in states else "")
        if not run_id:
            why = ("no run of this deployment names it (tag trainwise:run="
                   f"{instance.run_id!r})" if instance.run_id else
                   "no run of this deployment launched it")
        elif states[run_id].live:
            continue
        else:
            why = states[run_id].why
        orphans.append(Orphan(instance.instance_id, instance.zone, instance.instance_type,
                              instance.launched_at_s, run_id, why))
    return orphans


def terminate_orphans(provider: Any, orphans: list[Orphan], *, terminate_unknown: bool = False
                      ) -> tuple[list[Orphan], list[Orphan]]:
    """(terminated, left alone): this deployment's orphans are terminated; unknown ones only
    when `terminate_unknown`."""
    chosen = [o for o in orphans if terminate_unknown or not o.unknown]
    left = [o for o in orphans if o not in chosen]
    provider.terminate_instances([o.instance_id for o in chosen])
    return chosen, left


def describe(orphans: list[Orphan], now_wall_s: float | None = None) -> list[str]:
    """One line per orphan: the instance, where, how long it has been up, whose, why."""
    now = time.time() if now_wall_s is None else now_wall_s
    return [f"{o.instance_id} ({o.instance_type} in {o.zone}, up "
            f"{max(0.0, now - o.launched_at_s) / 3600:.1f} h, run {o.run_id or 'unknown'}): "
            f"{o.why}" for o in orphans]


def regions_to_check(state_dir: Path, default_region: str) -> list[str]:
    """The settings' region and every region an aws run of this deployment held nodes in."""
    from cloud.collections import region_of_zone

    regions = {default_region}
    for run_dir in sorted((Path(state_dir) / "runs").glob(f"*/{GANG_FILE}")):
        try:
            record = json.loads(run_dir.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if record.get("provider") == "aws" and record.get("zone"):
            regions.add(region_of_zone(str(record["zone"])))
    return sorted(regions)


# The providers whose nodes outlive the process that launched them.
NODE_PROVIDERS = ("aws", "kubernetes")


def find_orphans_on_provider(provider_name: str, state_dir: Path, default_region: str
                             ) -> dict[str, tuple[Any, list]]:
    """{where: (what to terminate them with, the orphans)}: aws per region
    (`find_orphans_on_aws`), kubernetes in the settings' namespace (the pods labelled
    `trainwise/run`). ValueError for a provider whose nodes are this machine."""
    if provider_name == "aws":
        return find_orphans_on_aws(state_dir, default_region)
    if provider_name == "kubernetes":
        from cloud.providers.kubernetes_pods import PodSweep

        sweep = PodSweep.from_settings()
        return {f"namespace {sweep.namespace}": (sweep, find_orphans(sweep, state_dir))}
    raise ValueError(f"provider {provider_name!r} launches no nodes that outlive this process; "
                     f"orphans are looked for on {', '.join(NODE_PROVIDERS)}")


def find_orphans_on_aws(state_dir: Path, default_region: str) -> dict[str, tuple[Any, list]]:
    """{region: (its provider, its orphans)} over `regions_to_check`."""
    from cloud.providers.aws import AwsProvider, ec2_endpoint_url  # boto3: aws only

    found = {}
    for region in regions_to_check(state_dir, default_region):
        provider = AwsProvider(region, endpoint_url=ec2_endpoint_url())
        found[region] = (provider, find_orphans(provider, state_dir))
    return found
