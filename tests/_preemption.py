"""A spot reclaim at one step, without signalling the test process.

The training loop notes a SIGTERM with a handler (`training._loop_fast.PreemptionSignal`) that
only records the notice; the loop acts on it at the next step boundary. `request_preemption`
asks the running loop for that same stop through the product's own hook
(`training.loop.request_stop`, what the in-process engine's provider session calls on a
reclaim), so nothing is sent to the process: when no loop is running (the policy called
outside the loop), the test fails with a RuntimeError instead of pytest being terminated by its
own SIGTERM.
"""

from __future__ import annotations

from controllers.fast_types import NoOpFastPolicy
from training.loop import request_stop


def request_preemption() -> None:
    """Hands the training loop the notice a SIGTERM gives it (see the module docstring)."""
    request_stop("SIGTERM")


class SigtermAt(NoOpFastPolicy):
    """Keeps everything, but gets a preemption notice (SIGTERM) at one step: a spot reclaim."""

    name = "sigterm_at"

    def __init__(self, step: int) -> None:
        self.step = step

    def act(self, observation):
        if observation.step == self.step and observation.preemption_notice_s is None:
            request_preemption()
        return super().act(observation)
