-- Where the time went besides training steps: checkpoint saves, evaluations, and preemption
-- waste (steps and evals replayed after a resume from an older checkpoint: is_replay). Replayed
-- work is counted once, as waste; step_s is new training only.
with per_run as (
    select
        run_id,
        run_instance,
        coalesce(sum(cast(payload ->> 'step_time_ms' as double))
            filter (where event_type = 'step' and not is_replay), 0) / 1000.0 as step_s,
        coalesce(sum(cast(payload ->> 'save_ms' as double))
            filter (where event_type = 'checkpoint'), 0) / 1000.0 as checkpoint_s,
        coalesce(sum(cast(payload ->> 'eval_ms' as double))
            filter (where event_type = 'eval' and not is_replay), 0) / 1000.0 as eval_s,
        (coalesce(sum(cast(payload ->> 'step_time_ms' as double))
            filter (where event_type = 'step' and is_replay), 0)
         + coalesce(sum(cast(payload ->> 'eval_ms' as double))
            filter (where event_type = 'eval' and is_replay), 0)) / 1000.0 as preemption_s,
        count(*) filter (where event_type = 'step' and is_replay) as replayed_steps
    from {{ source('telemetry', 'telemetry_events') }}
    group by run_id, run_instance
)
select
    run_id,
    run_instance,
    step_s,
    checkpoint_s,
    eval_s,
    preemption_s,
    replayed_steps,
    checkpoint_s / nullif(step_s + checkpoint_s + eval_s + preemption_s, 0) as checkpoint_share,
    eval_s / nullif(step_s + checkpoint_s + eval_s + preemption_s, 0) as eval_share,
    preemption_s / nullif(step_s + checkpoint_s + eval_s + preemption_s, 0) as preemption_share
from per_run
