"""trainwise's SDK: a user's own training job under trainwise (`trainwise.init`, `Run`).

`trainwise.sdk.run` holds the run and its four calls (`dataloader`, `track`, `step`, `finish`);
`trainwise.sdk.spec` what a launcher tells the job; `trainwise.sdk.data` the resumable order;
`trainwise.sdk.hf` and `trainwise.sdk.lightning` the framework callbacks (imported on use: each
needs its framework installed).
"""

from typing import Any

__all__ = ["Capabilities", "ModelChangedError", "Preempted", "Run", "init"]


def __getattr__(name: str) -> Any:
    # On first use: `trainwise.sdk.spec` (what a launcher and the node agent read) must not pay
    # torch's import (1.3 s), which the code location paid at every load through the agent.
    if name in __all__:
        from trainwise.sdk import run

        return getattr(run, name)
    raise AttributeError(f"module 'trainwise.sdk' has no attribute {name!r}")
