-- Dollars per million tokens: the figure a platform engineer compares across runs.
-- One row per run instance (an unrelated run that reused a run id is a separate instance).
-- Steps replayed after a resume (is_replay) are paid for but add no tokens: their time, priced
-- at the run's hourly price, is preemption waste and is inside cost_usd, never new training.
-- The bill (issue 31, class 4): telemetry is a folder anyone can add a sealed segment to, so a
-- run whose trainer kept a run ledger (source ledger_bills) is billed its ledger clock at its
-- hourly price (the ledger's start line's, under its mac), and only its telemetry steps up to
-- the ledger's newest step count; a run
-- without a ledger (older runs) is billed from telemetry. billing_basis says which.
{% set ledger_relation = load_relation(source('telemetry', 'ledger_bills')) %}
with ledger as (
{% if ledger_relation is not none %}
    select run_id, run_instance, max(max_step) as max_step, max(elapsed_s) as elapsed_s,
           max(price_usd_per_hour) as price_usd_per_hour
    from {{ source('telemetry', 'ledger_bills') }}
    where run_instance is not null and elapsed_s is not null
    group by run_id, run_instance
{% else %}
    -- no ledger_bills table yet (a database ingested before it existed): every run is older
    select null::varchar as run_id, null::varchar as run_instance, null::bigint as max_step,
           null::double as elapsed_s, null::double as price_usd_per_hour
    where false
{% endif %}
),
events as (
    select e.*
    from {{ source('telemetry', 'telemetry_events') }} e
    left join ledger l using (run_id, run_instance)
    where l.run_id is null or e.step <= l.max_step
),
steps as (
    select
        run_id,
        run_instance,
        max(cast(payload ->> 'cost_usd' as double)) as cost_usd,
        max(cast(payload ->> 'elapsed_s' as double)) as elapsed_s,
        max(cast(payload ->> 'tokens_seen' as bigint)) filter (where not is_replay) as tokens_seen,
        max(cast(payload ->> 'samples_seen' as bigint)) filter (where not is_replay)
            as samples_seen,
        max(step) filter (where not is_replay) as steps,
        count(*) filter (where is_replay) as replayed_steps,
        coalesce(sum(cast(payload ->> 'step_time_ms' as double)) filter (where is_replay), 0)
            / 1000.0 as replay_s
    from events
    where event_type = 'step'
    group by run_id, run_instance
),
prices as (
    select run_id, run_instance,
           max(cast(payload ->> 'price_usd_per_hour' as double)) as price_usd_per_hour
    from {{ source('telemetry', 'telemetry_events') }}
    where event_type = 'run_start'
    group by run_id, run_instance
),
billed as (
    select
        s.*,
        -- the ledger's price is under its mac; a run_start row's is a telemetry claim
        coalesce(l.price_usd_per_hour, p.price_usd_per_hour) as price_usd_per_hour,
        l.run_id is not null
            and coalesce(l.price_usd_per_hour, p.price_usd_per_hour) is not null as from_ledger,
        l.elapsed_s as ledger_elapsed_s
    from steps s
    left join prices p using (run_id, run_instance)
    left join ledger l using (run_id, run_instance)
)
select
    run_id,
    run_instance,
    steps,
    tokens_seen,
    samples_seen,
    cost_usd,
    case when tokens_seen > 0 then cost_usd / tokens_seen * 1e6 end as usd_per_million_tokens,
    replayed_steps,
    replay_s,
    replay_s * coalesce(price_usd_per_hour, 0) / 3600.0 as preemption_waste_usd,
    billed_elapsed_s,
    billing_basis
from (
    select
        * exclude (cost_usd, elapsed_s),
        case when from_ledger then ledger_elapsed_s * price_usd_per_hour / 3600.0
             else cost_usd end as cost_usd,
        case when from_ledger then ledger_elapsed_s else elapsed_s end as billed_elapsed_s,
        case when from_ledger then 'ledger' else 'telemetry' end as billing_basis
    from billed
)
