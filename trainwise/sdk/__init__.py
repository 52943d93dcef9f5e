"""trainwise's SDK: a user's own training job under trainwise (`trainwise.init`, `Run`).

`trainwise.sdk.run` holds the run and its four calls (`dataloader`, `track`, `step`, `finish`);
`trainwise.sdk.spec` what a launcher tells the job; `trainwise.sdk.data` the resumable order;
`trainwise.sdk.hf` and `trainwise.sdk.lightning` the framework callbacks (imported on use: each
needs its framework installed).
"""

from trainwise.sdk.run import Capabilities, ModelChangedError, Preempted, Run, init

__all__ = ["Capabilities", "ModelChangedError", "Preempted", "Run", "init"]
