-- Dollars per million tokens: the figure a platform engineer compares across runs.
with steps as (
    select
        run_id,
        max(cast(payload ->> 'cost_usd' as double)) as cost_usd,
        max(cast(payload ->> 'tokens_seen' as bigint)) as tokens_seen,
        max(cast(payload ->> 'samples_seen' as bigint)) as samples_seen,
        max(step) as steps
    from {{ source('telemetry', 'telemetry_events') }}
    where event_type = 'step'
    group by run_id
)
select
    run_id,
    steps,
    tokens_seen,
    samples_seen,
    cost_usd,
    case when tokens_seen > 0 then cost_usd / tokens_seen * 1e6 end as usd_per_million_tokens
from steps
