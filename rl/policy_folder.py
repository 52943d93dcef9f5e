"""Where one region's policy files live: `<TRAINWISE_HOME>/policies/<kind>/<region>/`.

A leaf of its own so the retraining (`rl.retrain`, which writes candidates and the champion) and
the gate's rollback (`rl.gate`, which restores one) both read it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from trainwise import settings


def policy_dir(kind: str, region: str) -> Path:
    return settings.home_dir() / "policies" / kind / region
