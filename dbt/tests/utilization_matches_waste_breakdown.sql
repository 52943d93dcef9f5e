-- utilization and waste_breakdown read the same events: per run instance, the time in steps
-- (compute + waiting at the all-reduce), checkpoints, evals and replays must agree.
-- An asset check of utilization (dagster-dbt attaches a two-model test through meta.dagster.ref).
{{ config(meta={'dagster': {'ref': {'name': 'utilization'}}}) }}
with u as (
    select run_id, run_instance,
           sum(compute_s + straggler_wait_s + allreduce_s) as step_s,
           sum(checkpoint_s) as checkpoint_s, sum(eval_s) as eval_s,
           sum(preemption_s) as preemption_s
    from {{ ref('utilization') }}
    group by run_id, run_instance
)
select u.run_id, u.run_instance
from u
join {{ ref('waste_breakdown') }} w using (run_id, run_instance)
where abs(u.step_s - w.step_s) > 1e-6 or abs(u.checkpoint_s - w.checkpoint_s) > 1e-6
   or abs(u.eval_s - w.eval_s) > 1e-6 or abs(u.preemption_s - w.preemption_s) > 1e-6
