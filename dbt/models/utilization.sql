-- Where each rank's wall time went: computing, waiting (for the slowest rank at the all-reduce,
-- and the all-reduce itself), checkpointing, evaluating, lost to preemption (steps and evals
-- replayed after a resume), and the rest (start-up, data loading between steps, the gap between
-- a kill and its resume). One row per rank of a run instance.
--
-- Why per rank: store.py keys run_instance on each rank's first segment, so every rank of a run
-- has its own run_instance and nothing in the telemetry ties ranks of one instance together; a
-- run's own figures are the sums of its ranks' seconds (same run_id, when the id was not reused).
--
-- Step time splits as in training/distributed.py: compute_ms, then the timed wait for the
-- slowest rank (allreduce_wait_ms), then the all-reduce (allreduce_ms); compute is what remains
-- (optimizer step included), so compute + waits = the step time that waste_breakdown counts
-- (a single process records no waits: all of its step is compute). Replayed work is counted
-- once, as preemption, as in waste_breakdown (dbt/tests/utilization_matches_waste_breakdown).
--
-- Wall time: from the start of the billing clock (training/loop.py bills set-up too: a step's
-- or run_end's wall_time_s minus its elapsed_s), or of the rank's first event when that is
-- earlier (its timestamp minus its own duration), to its last event; never less than the time
-- the events account for (clocks of a restarted process may disagree). Every share is a
-- fraction of it, and they add up to 1.
with events as (
    select
        run_id,
        run_instance,
        rank,
        event_type,
        is_replay,
        wall_time_s,
        cast(payload ->> 'world_size' as integer) as world_size,
        coalesce(cast(payload ->> 'step_time_ms' as double), 0) / 1000.0 as step_s,
        coalesce(cast(payload ->> 'allreduce_wait_ms' as double), 0) / 1000.0 as wait_s,
        coalesce(cast(payload ->> 'allreduce_ms' as double), 0) / 1000.0 as allreduce_s,
        coalesce(cast(payload ->> 'save_ms' as double), 0) / 1000.0 as save_s,
        coalesce(cast(payload ->> 'eval_ms' as double), 0) / 1000.0 as eval_s,
        case when event_type in ('step', 'run_end')
             then cast(payload ->> 'elapsed_s' as double) end as elapsed_s
    from {{ source('telemetry', 'telemetry_events') }}
),
per_rank as (
    select
        run_id,
        run_instance,
        rank,
        coalesce(max(world_size), 1) as world_size,
        coalesce(sum(step_s - wait_s - allreduce_s)
            filter (where event_type = 'step' and not is_replay), 0) as compute_s,
        coalesce(sum(wait_s) filter (where event_type = 'step' and not is_replay), 0)
            as straggler_wait_s,
        coalesce(sum(allreduce_s) filter (where event_type = 'step' and not is_replay), 0)
            as allreduce_s,
        coalesce(sum(save_s) filter (where event_type = 'checkpoint'), 0) as checkpoint_s,
        coalesce(sum(eval_s) filter (where event_type = 'eval' and not is_replay), 0) as eval_s,
        coalesce(sum(step_s) filter (where event_type = 'step' and is_replay), 0)
            + coalesce(sum(eval_s) filter (where event_type = 'eval' and is_replay), 0)
            as preemption_s,
        max(wall_time_s)
            - least(min(wall_time_s - case event_type when 'step' then step_s
                                                      when 'eval' then eval_s
                                                      when 'checkpoint' then save_s else 0 end),
                    coalesce(min(wall_time_s - elapsed_s), 'infinity'::double))
            as span_s
    from events
    group by run_id, run_instance, rank
),
timed as (
    select
        *,
        compute_s + straggler_wait_s + allreduce_s + checkpoint_s + eval_s + preemption_s
            as accounted_s
    from per_rank
),
walled as (
    select *, greatest(coalesce(span_s, 0), accounted_s) as wall_s
    from timed
)
select
    run_id,
    run_instance,
    rank,
    world_size,
    wall_s,
    compute_s,
    straggler_wait_s,
    allreduce_s,
    checkpoint_s,
    eval_s,
    preemption_s,
    wall_s - accounted_s as other_s,
    compute_s / wall_s as compute_share,
    (straggler_wait_s + allreduce_s) / wall_s as waiting_share,
    straggler_wait_s / wall_s as straggler_wait_share,
    allreduce_s / wall_s as allreduce_share,
    checkpoint_s / wall_s as checkpoint_share,
    eval_s / wall_s as eval_share,
    preemption_s / wall_s as preemption_share,
    (wall_s - accounted_s) / wall_s as other_share
from walled
-- A rank with no measured time (one event, nothing timed) has no shares to give.
where wall_s > 0
