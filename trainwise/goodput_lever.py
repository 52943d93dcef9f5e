"""The goodput batch lever (Pollux, OSDI'21) for a train run: `fast_policy: goodput`.

`controllers.batch_scaling.GoodputBatchPolicy` needs the throughput of each candidate batch on
the hardware the run is on, so it cannot be built by name alone like the other fast policies:
`goodput_policy` profiles a fresh copy of the run's model on the run's own data at start
(`training._loop_step.profile_samples_per_s`: thread CPU time, forward + backward, no optimizer
step), then the policy refreshes that profile from the run's step times. The profile stops at
the first batch that is not faster per sample by `GoodputConfig.min_speedup_per_sample`, so on
hardware where a bigger batch does not pay (a CPU) it costs a few steps' work and the policy keeps
the fixed batch without ever measuring the noise scale.

One rank only: the policy splits the global batch for one process; a multi-node gang is refused
with the fix named (`check_goodput_ranks`).
"""

from __future__ import annotations

import time
from typing import Any

from controllers.batch_scaling import GoodputBatchPolicy, GoodputConfig

# Candidates M0 x 2**k up to 8 x M0 (the time_to_quality benchmark's setting).
MAX_BATCH_FACTOR = 8


def check_goodput_ranks(fast_policy: str, nodes: int) -> None:
    """The goodput policy sets one process's batch; a gang of ranks is refused before launch."""
    if fast_policy == "goodput" and nodes > 1:
        raise ValueError(f"fast_policy 'goodput' runs on one node, this run has {nodes}: use "
                         "fast_policy 'heuristic' for a multi-node gang, or nodes 1")


def goodput_policy(config: Any, examples: Any) -> tuple[GoodputBatchPolicy, str]:
    """(policy, reason): the goodput policy on a throughput profile of the run's model measured
    now on this machine. `config`: the run's `training.loop.TrainConfig`."""
    import torch

    from training._loop_step import profile_samples_per_s
    from training.loop import default_model_config
    from training.model import MODEL_KIND_FOR_DATA, build_model

    base = config.micro_batch_size * config.grad_accum_steps
    goodput = GoodputConfig(base_batch=base, max_batch_factor=MAX_BATCH_FACTOR)
    began = time.thread_time()
    # A separate model from the same seed: the run's own model and RNG streams are untouched.
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    probe = build_model(MODEL_KIND_FOR_DATA[examples.kind],
                        config.model or default_model_config(examples))
    torch.random.set_rng_state(generator_state)
    profile = profile_samples_per_s(probe, examples, goodput.candidates(), seed=config.seed,
                                    stop_below_speedup=goodput.min_speedup_per_sample)
    spent_s = time.thread_time() - began
    rates = ", ".join(f"{batch}: {rate:.0f}" for batch, rate in sorted(profile.items()))
    reason = (f"goodput requested: throughput profiled at start in {spent_s:.2f} CPU-s "
              f"(samples/s by batch: {rates})")
    return GoodputBatchPolicy(profile, goodput), reason
