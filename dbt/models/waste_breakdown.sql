-- Where the time went besides training steps: checkpoint saves and evaluations.
with per_run as (
    select
        run_id,
        sum(case when event_type = 'step' then cast(payload ->> 'step_time_ms' as double) else 0 end)
            / 1000.0 as step_s,
        sum(case when event_type = 'checkpoint' then cast(payload ->> 'save_ms' as double) else 0 end)
            / 1000.0 as checkpoint_s,
        sum(case when event_type = 'eval' then cast(payload ->> 'eval_ms' as double) else 0 end)
            / 1000.0 as eval_s
    from {{ source('telemetry', 'telemetry_events') }}
    group by run_id
)
select
    run_id,
    step_s,
    checkpoint_s,
    eval_s,
    checkpoint_s / nullif(step_s + checkpoint_s + eval_s, 0) as checkpoint_share,
    eval_s / nullif(step_s + checkpoint_s + eval_s, 0) as eval_share
from per_run
