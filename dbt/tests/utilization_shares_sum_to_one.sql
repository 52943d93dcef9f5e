-- Every second of a rank's wall time is in exactly one bucket: the shares add up to 1.
select run_id, run_instance, rank,
       compute_share + waiting_share + checkpoint_share + eval_share + preemption_share
           + other_share as total_share
from {{ ref('utilization') }}
where abs(compute_share + waiting_share + checkpoint_share + eval_share + preemption_share
          + other_share - 1) > 1e-9
