"""The two gymnasium environments (see `rl.slow_env` and `rl.fast_env` for their rules)."""

from rl.fast_env import FastEnv
from rl.slow_env import SlowEnv

__all__ = ["FastEnv", "SlowEnv"]
