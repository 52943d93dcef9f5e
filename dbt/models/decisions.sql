select
    run_id,
    run_instance,
    step,
    wall_time_s,
    payload ->> 'layer' as layer,
    payload ->> 'policy' as policy,
    payload ->> 'reason' as reason,
    payload -> 'action' as action,
    payload -> 'numbers' as numbers
from {{ source('telemetry', 'telemetry_events') }}
where event_type = 'decision'
