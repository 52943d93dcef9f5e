"""The fast layer's learned-policy contract: observation vector and action menu.

Observation: `fast_features(obs, heuristic_action)` summarises a `FastObservation` (and what the
heuristic fast policy would do now) as a float32 vector with layout `FAST_OBS_LAYOUT`, the same
for any number of ranks (rank times are summarised as max / min over the median).

Action: `MultiDiscrete([len(SHARE_CHOICES), len(BATCH_CHOICES), len(NOTICE_CHOICES)])`; 0 in
every component is "as the heuristic" (the residual's zero), so a policy that always outputs 0 is
the heuristic itself.
"""

from __future__ import annotations

import math

import numpy as np

from controllers.fast_types import FastAction, FastObservation, PreemptionResponse

SHARE_CHOICES = ("heuristic", "equal", "proportional")
BATCH_CHOICES = ("heuristic", "halve", "double")
NOTICE_CHOICES = ("heuristic", "continue", "checkpoint_now", "migrate")
NOTICE_RESPONSES = (None, PreemptionResponse.CONTINUE, PreemptionResponse.CHECKPOINT_NOW,
                    PreemptionResponse.MIGRATE)

FAST_OBS_LAYOUT = (
    "log2_global_batch", "log2_noise_over_batch", "max_over_median_step", "min_over_median_step",
    "notice_pending", "notice_left_frac", "since_checkpoint_h", "checkpoint_cost_min",
    "preemption_risk", "heur_batch_direction", "heur_share_spread",
    "heur_continue", "heur_checkpoint", "heur_migrate",
)
FAST_OBS_SIZE = len(FAST_OBS_LAYOUT)


def fast_features(obs: FastObservation, heuristic: FastAction) -> np.ndarray:
    times = sorted(obs.rank_step_time_ms)
    median = times[len(times) // 2]
    global_batch = obs.micro_batch_size * obs.grad_accum_steps * len(times)
    heur_batch = heuristic.micro_batch_size * heuristic.grad_accum_steps * len(times)
    noise = obs.grad_noise_scale
    noise_ratio = math.log2(noise / global_batch) if noise == noise and noise > 0 else 0.0
    notice = obs.preemption_notice_s
    response = heuristic.preemption_response
    cost = obs.checkpoint_cost_s if obs.checkpoint_cost_s == obs.checkpoint_cost_s else 60.0
    shares = heuristic.rank_work_shares
    return np.asarray((
        math.log2(global_batch),
        noise_ratio,
        times[-1] / median,
        times[0] / median,
        float(notice is not None),
        (notice or 0.0) / 120.0,
        obs.seconds_since_checkpoint / 3600.0,
        cost / 60.0,
        obs.preemption_risk,
        float(np.sign(heur_batch - global_batch)),
        (max(shares) - min(shares)) * len(shares),
        float(response == PreemptionResponse.CONTINUE),
        float(response == PreemptionResponse.CHECKPOINT_NOW),
        float(response == PreemptionResponse.MIGRATE),
    ), dtype=np.float32)


def apply_fast_choice(obs: FastObservation, heuristic: FastAction, share: int, batch: int,
                      notice: int, max_micro_batch: int = 64) -> FastAction:
    """The action the loop gets: the heuristic's, with the chosen components overridden."""
    if not (0 <= share < len(SHARE_CHOICES) and 0 <= batch < len(BATCH_CHOICES)
            and 0 <= notice < len(NOTICE_CHOICES)):
        raise ValueError(
            f"fast action ({share}, {batch}, {notice}) is out of range; valid: shares "
            f"{SHARE_CHOICES}, batch {BATCH_CHOICES}, notice {NOTICE_CHOICES} (indices)"
        )
    ranks = len(obs.rank_step_time_ms)
    shares = heuristic.rank_work_shares
    if SHARE_CHOICES[share] == "equal":
        shares = tuple(1.0 / ranks for _ in range(ranks))
    elif SHARE_CHOICES[share] == "proportional":
        speeds = [1.0 / t for t in obs.rank_step_time_ms]
        total = sum(speeds)
        shares = tuple(v / total for v in speeds)
    micro, accum, lr = heuristic.micro_batch_size, heuristic.grad_accum_steps, heuristic.learning_rate
    if BATCH_CHOICES[batch] != "heuristic":
        factor = 0.5 if BATCH_CHOICES[batch] == "halve" else 2.0
        per_rank = max(1, int(obs.micro_batch_size * obs.grad_accum_steps * factor))
        accum = max(1, math.ceil(per_rank / max_micro_batch))
        micro = max(1, per_rank // accum)
        lr = obs.learning_rate * math.sqrt(micro * accum / (obs.micro_batch_size * obs.grad_accum_steps))
    response = NOTICE_RESPONSES[notice] or heuristic.preemption_response
    if obs.preemption_notice_s is None:
        response = PreemptionResponse.CONTINUE
    return FastAction(micro, accum, lr, shares, response, f"rl fast ({share},{batch},{notice})")
