"""Nothing billed runs idle: a sensor that finds aws nodes no live run holds (left by a run that
ended or a code location that died) and asks for a recorded `terminate_orphan_nodes` run.

Pure, as every sensor here: it reads EC2 (describe_instances) and the run folders, and returns a
run request or a skip reason. On by default when TRAINWISE_PROVIDER is `aws`, so its first tick
comes soon after the daemon starts: a restart of the code location cleans up after the process
it replaced.
"""

import hashlib

import dagster as dg

from cloud.providers.base import ProviderError
from pipelines.jobs import orphan_nodes_job
from trainwise import orphan_nodes, settings

INTERVAL_S = 300


@dg.sensor(job=orphan_nodes_job, minimum_interval_seconds=INTERVAL_S,
           default_status=(dg.DefaultSensorStatus.RUNNING
                           if settings.get("TRAINWISE_PROVIDER") in orphan_nodes.NODE_PROVIDERS
                           else dg.DefaultSensorStatus.STOPPED))
def orphan_nodes_sensor(context: dg.SensorEvaluationContext):
    """Orphaned nodes of this deployment (aws instances, kubernetes pods) -> one
    terminate_orphan_nodes run per set."""
    provider = settings.get("TRAINWISE_PROVIDER")
    if provider not in orphan_nodes.NODE_PROVIDERS:
        return dg.SkipReason(f"TRAINWISE_PROVIDER is not {' or '.join(orphan_nodes.NODE_PROVIDERS)}"
                             ": no nodes of ours to look for")
    try:
        found = orphan_nodes.find_orphans_on_provider(provider, settings.home_dir(),
                                                      settings.get("TRAINWISE_REGION"))
    except (ProviderError, ValueError) as error:
        return dg.SkipReason(f"{'EC2' if provider == 'aws' else provider} could not be read: "
                             f"{error}")
    ours = [o for _, orphans in found.values() for o in orphans if not o.unknown]
    unknown = [o for _, orphans in found.values() for o in orphans if o.unknown]
    note = (f"; {len(unknown)} tagged node(s) unknown to this deployment left alone: "
            + "; ".join(orphan_nodes.describe(unknown)))[:900] if unknown else ""
    if not ours:
        return dg.SkipReason(f"no orphaned node of this deployment{note}")
    ids = sorted(o.instance_id for o in ours)
    return dg.RunRequest(
        run_key="orphans:" + hashlib.sha256(",".join(ids).encode()).hexdigest()[:16],
        run_config={"ops": {"terminate_orphans_op": {"config": {"instance_ids": ids}}}},
        tags={"trainwise/reason": ("; ".join(orphan_nodes.describe(ours)) + note)[:250]})
