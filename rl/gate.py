"""Promotion gate: a candidate replaces the incumbent only when the held-out evaluation says so.

Rule (both must hold):
- cheaper by the margin: total candidate cost <= (1 - `margin`) x total incumbent cost over the
  same held-out cells (default margin 1 %);
- never more deadline misses than the incumbent (a miss is not traded for dollars).
The simulator has no model-quality signal (pruning is not a choice of these policies), so "never
a quality violation" reduces to the deadline rule here.

The decision carries its figures (totals, the cost ratio with a 95 % paired-bootstrap interval
over cells, misses) and is written as JSON by `record_decision`.

Slow policies are evaluated on cost-suite cells (`evaluate_slow`, USD); fast policies on held-out
FastEnv seeds (`evaluate_fast`), where the "cost" is wall-clock seconds per 100 ideal steps.

Rollback (the `policy_rollback` job): `propose_rollback` writes a proposal (kind, version, who,
why) for a region; the blocking check calls `publish_rollback`, which restores the version only
when its file loads (`load_policy`: format, kind, layout, region, finite weights, hash) and it was
promoted before (registry `gate_status`, its gate_v<N>.json, or the history), or the proposal
says `allow_unpromoted` (recorded). The registry's `champion` alias moves first (`rl.registry.
record_rollback`), then champion.npz is replaced atomically, so the loader's sha256 check agrees;
a refusal at any step leaves the incumbent in charge. Every proposal, refusal and rollback is a
line of `<policy dir>/history.jsonl` (from, to, requested_by, why, time).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from cloud.scenarios import Scenario
from cloud.simulator import simulate
from controllers.allocation_types import AllocationPolicy
from rl import registry
from rl._files import append_line, write_atomic
from rl.cells import cell_label
from rl.fast_obs import FAST_OBS_LAYOUT
from rl.policy_file import PolicyFileError, load_policy, read_header
from rl.policy_folder import policy_dir
from rl.registry import RegistryUnavailable, version_gate_status
from rl.slow_obs import SLOW_OBS_LAYOUT
from trainwise import settings

DEFAULT_MARGIN = 0.01


@dataclass
class GateDecision:
    promote: bool
    reason: str
    margin: float
    candidate_total: float
    incumbent_total: float
    cost_ratio: float
    cost_ratio_ci95: tuple[float, float]
    candidate_misses: int
    incumbent_misses: int
    cells: int
    unit: str = "usd"
    per_cell: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_slow(make: Callable[[Scenario], AllocationPolicy], cells: Sequence[Scenario]) -> list[dict]:
    rows = []
    for cell in cells:
        result = simulate(make(cell), cell.job, cell.rules, cell.market, home_zone=cell.home_zone)
        rows.append({"cell": cell_label(cell), "cost": result.cost_usd,
                     "missed": not result.deadline_met})
    return rows


def evaluate_fast(make_policy_action: Callable, seeds: Sequence[int], env_kwargs: dict | None = None
                  ) -> list[dict]:
    """`make_policy_action()` returns a fresh `(obs_vector) -> action` callable per episode."""
    from rl.fast_env import FastEnv  # gymnasium costs about 0.3 s; only fast gates need it

    env = FastEnv(**(env_kwargs or {}))
    rows = []
    for seed in seeds:
        act = make_policy_action()
        obs, _ = env.reset(seed=int(seed))
        while True:
            obs, _, terminated, truncated, info = env.step(np.asarray(act(obs)))
            if terminated or truncated:
                break
        seconds = env.t * env.tick_s
        rows.append({"cell": f"fast/seed{seed}", "cost": seconds / max(info["progress"], 1e-9) * 100,
                     "missed": False})
    return rows


def _bootstrap_ratio(cand: np.ndarray, inc: np.ndarray, seed: int = 0, n: int = 2000
                     ) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(cand), size=(n, len(cand)))
    ratios = cand[idx].sum(axis=1) / inc[idx].sum(axis=1)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def decide(candidate: list[dict], incumbent: list[dict], margin: float = DEFAULT_MARGIN,
           unit: str = "usd") -> GateDecision:
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin} must be in [0, 1)")
    if [r["cell"] for r in candidate] != [r["cell"] for r in incumbent] or not candidate:
        raise ValueError("candidate and incumbent must be evaluated on the same, non-empty cells")
    cand = np.array([r["cost"] for r in candidate], dtype=float)
    inc = np.array([r["cost"] for r in incumbent], dtype=float)
    if not (np.isfinite(cand).all() and np.isfinite(inc).all()):
        return GateDecision(False, "refused: non-finite cost in the evaluation", margin,
                            float("nan"), float("nan"), float("nan"), (float("nan"),) * 2, 0, 0,
                            len(cand), unit)
    c_miss = sum(r["missed"] for r in candidate)
    i_miss = sum(r["missed"] for r in incumbent)
    ratio = float(cand.sum() / inc.sum())
    ci = _bootstrap_ratio(cand, inc)
    if c_miss > i_miss:
        promote, reason = False, (f"refused: {c_miss} deadline misses vs the incumbent's {i_miss} "
                                  "(misses are never traded for cost)")
    elif ratio > 1 - margin:
        promote, reason = False, (f"refused: cost ratio {ratio:.4f} is not below 1 - margin = "
                                  f"{1 - margin:.4f}")
    else:
        promote, reason = True, (f"promoted: cost ratio {ratio:.4f} <= {1 - margin:.4f}, misses "
                                 f"{c_miss} <= {i_miss}")
    per_cell = [{"cell": a["cell"], "candidate": a["cost"], "incumbent": b["cost"],
                 "candidate_missed": a["missed"], "incumbent_missed": b["missed"]}
                for a, b in zip(candidate, incumbent)]
    return GateDecision(promote, reason, margin, float(cand.sum()), float(inc.sum()), ratio, ci,
                        int(c_miss), int(i_miss), len(cand), unit, per_cell)


def record_decision(decision: GateDecision, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({**decision.to_dict(), **(extra or {})}, indent=2,
                                  default=str).encode("utf-8"))
    return path


# --- rollback ------------------------------------------------------------------------------------
HISTORY_NAME = "history.jsonl"
PROMOTED_STATUSES = ("promoted", "restored")


def _layout(kind: str) -> tuple[str, ...]:
    if kind not in ("slow", "fast"):
        raise ValueError(f"kind {kind!r} must be 'slow' or 'fast' (run config `kind`)")
    return SLOW_OBS_LAYOUT if kind == "slow" else FAST_OBS_LAYOUT


def proposal_path(region: str) -> Path:
    """One pending rollback proposal per region (the check is partitioned by region only)."""
    return settings.home_dir() / "policies" / "_rollback" / region / "proposal.json"


def append_history(kind: str, region: str, record: dict) -> dict:
    now = time.time()
    record = {"at_s": now, "at_utc": dt.datetime.fromtimestamp(now, dt.UTC).isoformat(
        timespec="seconds"), "kind": kind, "region": region, **record}
    folder = policy_dir(kind, region)
    folder.mkdir(parents=True, exist_ok=True)
    append_line(folder / HISTORY_NAME, json.dumps(record, sort_keys=True, default=str) + "\n")
    return record


def read_history(kind: str, region: str) -> list[dict]:
    path = policy_dir(kind, region) / HISTORY_NAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def stored_versions(kind: str, region: str) -> list[int]:
    folder = policy_dir(kind, region)
    return sorted(int(p.stem[1:]) for p in folder.glob("v*.npz") if p.stem[1:].isdigit())


def champion_label(kind: str, region: str) -> str:
    """What champion.npz holds now, for the record: 'v<N>', 'heuristic' (no file) or why not."""
    path = policy_dir(kind, region) / "champion.npz"
    if not path.is_file():
        return "heuristic"
    try:
        return f"v{int(read_header(path)['version'])}"
    except Exception as error:  # noqa: BLE001 - an unreadable champion is recorded as such
        return f"unreadable champion.npz ({type(error).__name__})"


def propose_rollback(kind: str, region: str, restore_version: int, *, reason: str,
                     requested_by: str, allow_unpromoted: bool = False) -> dict:
    """Writes the region's rollback proposal (the incumbent stays until the check publishes it).
    Refused (FileNotFoundError listing the stored versions, ValueError) when the version was
    never stored or no reason is given; the refusal is recorded in the history."""
    _layout(kind)
    base = {"requested_by": requested_by, "why": reason, "to": f"v{restore_version}",
            "from": champion_label(kind, region)}
    if not reason.strip():
        append_history(kind, region, {"event": "rollback_refused", **base,
                                      "failure": "no reason given"})
        raise ValueError("a policy rollback needs a reason (run config `reason`): it is recorded "
                         "in the policy history and the registry")
    stored = stored_versions(kind, region)
    if restore_version not in stored:
        folder = policy_dir(kind, region)
        message = (f"no {kind} policy v{restore_version} for {region} in {folder} to roll back "
                   f"to; stored versions: {', '.join(f'v{v}' for v in stored) or 'none'}")
        append_history(kind, region, {"event": "rollback_refused", **base, "failure": message})
        raise FileNotFoundError(message)
    proposal = {"kind": kind, "region": region, "restore_version": int(restore_version),
                "reason": reason, "requested_by": requested_by,
                "allow_unpromoted": bool(allow_unpromoted),
                "proposed_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    path = proposal_path(region)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(proposal, indent=2).encode("utf-8"))
    append_history(kind, region, {"event": "rollback_proposed", **base})
    return proposal


def _promotion_evidence(kind: str, region: str, version: int) -> str | None:
    """Why `version` counts as promoted before, or None. The registry is asked first; its
    answer 'refused' stands even if a file says otherwise."""
    try:
        status = version_gate_status(kind, region, version)
    except RegistryUnavailable:
        status = None
    if status is not None:
        return f"registry gate_status {status}" if status in PROMOTED_STATUSES else None
    gate_path = policy_dir(kind, region) / f"gate_v{version}.json"
    if gate_path.is_file() and json.loads(gate_path.read_text()).get("promote") is True:
        return f"{gate_path.name} promoted it"
    if any(r.get("event") == "rollback" and r.get("to") == f"v{version}"
           for r in read_history(kind, region)):
        return "restored by an earlier rollback"
    return None


def verify_rollback(proposal: dict) -> tuple[bool, str]:
    """(ok, reason): the restored file loads for its kind, layout and region, holds the version
    it is named for, and was promoted before (or the proposal allows it)."""
    kind, region, version = proposal["kind"], proposal["region"], int(proposal["restore_version"])
    path = policy_dir(kind, region) / f"v{version}.npz"
    try:
        weights = load_policy(path, kind, _layout(kind), region)
    except (PolicyFileError, KeyError, TypeError) as error:
        return False, f"refused: v{version} does not load ({error})"
    if weights.version != version:
        return False, (f"refused: {path.name} holds version {weights.version}, not {version} "
                       "(renamed file); restore the file under its own version")
    evidence = _promotion_evidence(kind, region, version)
    if evidence is None and not proposal.get("allow_unpromoted"):
        return False, (f"refused: {kind} v{version} for {region} was never promoted (the gate "
                       "refused it or never ran); set allow_unpromoted with a reason to restore "
                       "it anyway")
    return True, evidence or "never promoted; allowed by the proposal (allow_unpromoted)"


def _copy_atomically(source: Path, target: Path) -> None:
    # An unpredictable temp name: a fixed `.champion.npz.<pid>.tmp` could be a planted link,
    # written through (issue 31, class 2).
    write_atomic(target, source.read_bytes())


def publish_rollback(region: str, approved_by: str) -> dict | None:
    """Acts on the region's pending proposal (None when there is none): verify, move the
    registry alias, replace champion.npz, record. Returns {passed, reason, record}; the
    proposal is consumed either way (propose again to retry)."""
    path = proposal_path(region)
    if not path.is_file():
        return None
    proposal = json.loads(path.read_text())
    kind, version = proposal["kind"], int(proposal["restore_version"])
    folder = policy_dir(kind, region)
    base = {"from": champion_label(kind, region), "to": f"v{version}",
            "requested_by": proposal["requested_by"], "why": proposal["reason"],
            "approved_by": approved_by, "proposed_utc": proposal["proposed_utc"]}
    path.unlink()
    ok, reason = verify_rollback(proposal)
    if not ok:
        record = append_history(kind, region, {"event": "rollback_refused", **base,
                                               "failure": reason})
        return {"passed": False, "reason": f"{reason}; {base['from']} stays in charge",
                "record": record}
    source = folder / f"v{version}.npz"
    gate_path = folder / f"gate_v{version}.json"
    decision = json.loads(gate_path.read_text()) if gate_path.is_file() else {
        "reason": "restored by rollback (no gate record)"}
    try:
        got = registry.record_rollback(kind, region, source, decision,
                                       requested_by=proposal["requested_by"],
                                       reason=proposal["reason"])
    except Exception as error:  # noqa: BLE001 - the champion file is untouched: refused
        failure = (f"refused: registry not updated ({type(error).__name__}: {error}); run the "
                   "rollback again once MLflow answers")
        record = append_history(kind, region, {"event": "rollback_refused", **base,
                                               "failure": failure})
        return {"passed": False, "reason": f"{failure}; {base['from']} stays in charge",
                "record": record}
    champion = folder / "champion.npz"
    try:
        _copy_atomically(source, champion)
        load_policy(champion, kind, _layout(kind), region)
    except Exception:
        registry.restore_alias(kind, region, got["previous_champion"])
        raise
    record = append_history(kind, region, {
        "event": "rollback", **base, "promoted_before": reason,
        "registry": f"{got['model']} v{got['version']} @{registry.CHAMPION}",
        "registry_previous_champion": got["previous_champion"]})
    return {"passed": True, "reason": (f"rolled back {kind} {region} {base['from']} -> v{version} "
                                       f"({reason}); registry {record['registry']}"),
            "record": record}
