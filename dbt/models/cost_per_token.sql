-- Dollars per million tokens: the figure a platform engineer compares across runs.
-- One row per run instance (an unrelated run that reused a run id is a separate instance).
-- Steps replayed after a resume (is_replay) are paid for but add no tokens: their time, priced
-- at the run's hourly price, is preemption waste and is inside cost_usd, never new training.
with steps as (
    select
        run_id,
        run_instance,
        max(cast(payload ->> 'cost_usd' as double)) as cost_usd,
        max(cast(payload ->> 'tokens_seen' as bigint)) filter (where not is_replay) as tokens_seen,
        max(cast(payload ->> 'samples_seen' as bigint)) filter (where not is_replay)
            as samples_seen,
        max(step) filter (where not is_replay) as steps,
        count(*) filter (where is_replay) as replayed_steps,
        coalesce(sum(cast(payload ->> 'step_time_ms' as double)) filter (where is_replay), 0)
            / 1000.0 as replay_s
    from {{ source('telemetry', 'telemetry_events') }}
    where event_type = 'step'
    group by run_id, run_instance
),
prices as (
    select run_id, run_instance,
           max(cast(payload ->> 'price_usd_per_hour' as double)) as price_usd_per_hour
    from {{ source('telemetry', 'telemetry_events') }}
    where event_type = 'run_start'
    group by run_id, run_instance
)
select
    s.run_id,
    s.run_instance,
    s.steps,
    s.tokens_seen,
    s.samples_seen,
    s.cost_usd,
    case when s.tokens_seen > 0 then s.cost_usd / s.tokens_seen * 1e6 end as usd_per_million_tokens,
    s.replayed_steps,
    s.replay_s,
    s.replay_s * coalesce(p.price_usd_per_hour, 0) / 3600.0 as preemption_waste_usd
from steps s
left join prices p using (run_id, run_instance)
