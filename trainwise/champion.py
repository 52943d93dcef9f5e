"""Which policy is in charge for a region: the promoted champion (rl/) or the heuristic, and why.

The trainer (fast layer, `trainwise.runs.fast_policy`) and the slow tick (allocation slot,
`trainwise.slow_tick.decide`) ask here once per run / tick. The champion is
`<TRAINWISE_HOME>/policies/<kind>/<region>/champion.npz` (written by `rl.retrain.apply_gate`).
It is used only when `rl.policy_file.load_policy` accepts it (format, kind, layout, region,
shapes, finite weights, weights hash; numbers only, never unpickled); otherwise the heuristic
stays in charge and the reason carries the refusal, so the run's records say why. When the
MLflow Model Registry can be asked, the file must also be its `champion` version (same sha256,
`rl.registry`): a file replaced outside the gate is refused; an unreachable registry, or one
with no model for the region, leaves the file in charge and the reason says so. A NaN or
infinite observation at decision time is refused inside the learned policy, which then acts as
its heuristic for that decision (`rl.fast_path.Learned*Policy`).
"""

from __future__ import annotations

import os
from typing import Any

CHAMPION_FILE = "champion.npz"


def _in_charge(kind: str, region: str, heuristic: Any, wrap: Any) -> tuple[Any, str]:
    from rl.retrain import policy_dir

    path = policy_dir(kind, region) / CHAMPION_FILE
    name = getattr(heuristic, "name", type(heuristic).__name__)
    # Absent, not "not a file": a FIFO, a device link or a folder put there is refused by
    # load_policy with its reason, so the record says what was found.
    if not os.path.lexists(path):
        return heuristic, f"no {kind} champion for {region} ({path} absent): {name} in charge"
    try:
        policy = wrap(path)
    # load_policy raises only PolicyFileError (a ValueError) for whatever the file holds; the
    # learned wrappers raise ValueError for a layout they were not built for.
    except (ValueError, KeyError, TypeError, OSError) as error:
        return heuristic, f"{kind} champion for {region} refused ({error}); {name} stays in charge"
    accepted, registry_note = _registry_check(kind, region, path)
    if not accepted:
        return heuristic, (f"{kind} champion for {region} refused ({registry_note}); {name} stays "
                           "in charge")
    version = policy.network.weights.version
    return policy, (f"{kind} champion v{version} for {region} in charge ({path}), over {name}; "
                    f"{registry_note}")


def _registry_check(kind: str, region: str, path: Any) -> tuple[bool, str]:
    """The file must be the registry's champion (`rl.registry.verify_champion_file`); a registry
    that cannot be asked leaves the file in charge, with the reason in the note."""
    from rl.registry import verify_champion_file

    try:
        return verify_champion_file(kind, region, path)
    except Exception as error:  # noqa: BLE001 - a registry fault must not stop the run
        return True, f"registry not checked ({type(error).__name__}: {error})"


def fast_policy_in_charge(region: str, heuristic: Any) -> tuple[Any, str]:
    """(policy, reason): `LearnedFastPolicy(champion, heuristic)` or `heuristic`."""
    from rl.fast_obs import FAST_OBS_LAYOUT
    from rl.fast_path import LearnedFastPolicy, NumpyPolicy
    from rl.policy_file import load_policy

    return _in_charge("fast", region, heuristic, lambda path: LearnedFastPolicy(
        NumpyPolicy(load_policy(path, "fast", FAST_OBS_LAYOUT, region)), heuristic))


def slow_policy_in_charge(region: str, heuristic: Any) -> tuple[Any, str]:
    """(policy, reason): `LearnedAllocationPolicy(champion, heuristic)` or `heuristic` (an
    allocation policy, `AllocationObservation -> AllocationAction`)."""
    from rl.fast_path import LearnedAllocationPolicy

    return _in_charge("slow", region, heuristic,
                      lambda path: LearnedAllocationPolicy.from_file(path, heuristic, region))
