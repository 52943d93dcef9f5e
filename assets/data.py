"""Data as assets: shards -> difficulty scores -> curriculum (a candidate) -> gate -> published.

Write, audit, publish: `curriculum` writes a candidate version (LATEST untouched); the blocking
check `curriculum_coverage` audits it and, only when it passes, publishes it (moves LATEST, then
hands any live change of a running job over). Publishing inside the check keeps the asset graph
shards -> scores -> curriculum -> checkpoint: Dagster runs a blocking check before anything
downstream of `curriculum` (the `checkpoint` of `demo`) and skips that when the check fails, and
a standalone `train` reads only LATEST, so no failed candidate is ever trained on. The same
check is executable alone from the UI for one partition, a range, or none (all partitions).
"""
import json
import warnings
from collections.abc import Mapping

import dagster as dg

from assets.partitions import DATA_PARTITIONS, USER_DATASETS, data_partitions, require_builtin
from assets.resources import StateResource
from training import curriculum as curriculum_lib
from training import scoring, shards, user_datasets
from trainwise import schedule as schedule_lib
from trainwise import slow_tick


class CurriculumConfig(dg.Config):
    """How much of the easy data to prune, or which stored version to restore."""

    pruning_rate: float | None = None
    """Share of below-mean-loss examples dropped, in [0, 1); unset = the published schedule's."""
    seed: int = 0
    """Seed of the pruning draw (the manifest is reproducible for a seed)."""
    restore_version: str = ""
    """Rollback: propose this stored version again instead of building one (12 hex digits)."""
    reason: str = ""
    """Why this proposal (recorded in the curriculum history; required for a rollback)."""
    requested_by: str = ""
    """Who asks (a person's name, or the sensor); recorded in the curriculum history."""
    live_run_id: str = ""
    """A running job to hand the new pruning rate to once the gate passes (set by the sensor)."""


def data_shards_asset(partitions_def: dg.PartitionsDefinition,
                      registered: Mapping[str, user_datasets.DatasetSpec]) -> dg.AssetsDefinition:
    """`data_shards` over `partitions_def`, building the partitions named in `registered` (the
    project file's datasets) with `build_user_shards` and the others as built-ins. A factory
    because the module's partitions are read once, when the code location loads: a test builds
    the asset from a project file of its own the same way."""

    @dg.asset(name="data_shards", partitions_def=partitions_def, group_name="data",
              kinds={"parquet"})
    def data_shards(context: dg.AssetExecutionContext, state: StateResource) -> dg.MaterializeResult:
        """Parquet shards of one data set, written atomically, with a held-out eval split."""
        partition = context.partition_key
        if partition in registered:
            try:
                built = user_datasets.build_user_shards(registered[partition],
                                                        state.path("shards", partition))
            except (FileNotFoundError, ValueError) as error:  # the data's fault: say what to fix
                raise dg.Failure(description=str(error)) from error
            return dg.MaterializeResult(metadata=built.metadata())
        manifest = shards.build_shards(partition, state.data_dir(), state.path("shards", partition))
        return dg.MaterializeResult(metadata=shards.manifest_metadata(manifest))

    return data_shards


data_shards = data_shards_asset(data_partitions, USER_DATASETS)


@dg.asset(partitions_def=data_partitions, group_name="data", deps=[data_shards])
def difficulty_scores(
    context: dg.AssetExecutionContext, state: StateResource
) -> dg.MaterializeResult:
    """Per-example loss under a small reference model (the data's difficulty)."""
    partition = context.partition_key
    require_builtin(partition, "difficulty_scores")
    examples = shards.load_shards(state.path("shards", partition))
    table = scoring.difficulty_scores(examples)
    scoring.write_scores(table, state.path("scores", partition))
    return dg.MaterializeResult(metadata=scoring.score_metadata(table))


@dg.asset(partitions_def=data_partitions, group_name="data", deps=[difficulty_scores])
def curriculum(
    context: dg.AssetExecutionContext, config: CurriculumConfig, state: StateResource
) -> dg.MaterializeResult:
    """A candidate curriculum version (kept examples and loss weights); it becomes the one
    training reads only when `curriculum_coverage` passes."""
    partition = context.partition_key
    require_builtin(partition, "curriculum")
    folder = state.path("curricula", partition)
    requested_by = config.requested_by or context.run.tags.get("trainwise/layer", "") or "ui"
    if config.restore_version:
        built = curriculum_lib.propose_rollback(folder, config.restore_version,
                                                reason=config.reason, requested_by=requested_by)
        return dg.MaterializeResult(
            metadata={"version": built.version, "status": "candidate (rollback)",
                      "current": curriculum_lib.current_version(folder) or "none",
                      "pruning_rate": built.pruning_rate, "why": config.reason,
                      "requested_by": requested_by},
            tags={"trainwise/curriculum_version": built.version})
    # The published schedule's rate (trainwise.schedule) unless the run asks for one.
    rate = (schedule_lib.published(state.path()).schedule["pruning_rate"]
            if config.pruning_rate is None else config.pruning_rate)
    examples = shards.load_shards(state.path("shards", partition))
    table = scoring.read_scores(state.path("scores", partition))
    built = curriculum_lib.build_curriculum(examples, table, rate, seed=config.seed)
    summary = curriculum_lib.summarize_curriculum(built, examples, table)
    live_change = None
    if config.live_run_id:
        current = curriculum_lib.current_version(folder)
        from_rate = (curriculum_lib.load_curriculum(folder, current).pruning_rate
                     if current else None)
        live_change = {"run_id": config.live_run_id, "pruning_rate": rate,
                       "from_rate": from_rate, "reason": config.reason}
    path = curriculum_lib.propose_curriculum(built, folder, summary=summary, reason=config.reason,
                                             requested_by=requested_by, live_change=live_change)
    kept = int(len(built.example_ids))
    train_total = int(len(examples.train_positions))
    return dg.MaterializeResult(
        metadata={
            "version": built.version,
            "status": "candidate: published when curriculum_coverage passes",
            "current": curriculum_lib.current_version(folder) or "none",
            "pruning_rate": rate,
            "kept_examples": kept,
            "train_examples": train_total,
            "kept_share": kept / max(1, train_total),
            "manifest": dg.MetadataValue.path(str(path)),
        },
        tags={"trainwise/curriculum_version": built.version},
    )


def _checked_partitions(context: dg.AssetCheckExecutionContext) -> list[str]:
    """The partitions a check run covers: its partition, its range, or (a run launched with no
    partition, e.g. the check alone from an older UI) every data partition."""
    if context.has_partition_key:
        return [context.partition_key]
    if context.has_partition_key_range:
        return list(context.partition_keys)
    return list(DATA_PARTITIONS)


def audit_partition(state: StateResource, partition: str, approved_by: str) -> dict:
    """Audit one partition's candidate (else its current version) and publish a passing
    candidate. Returns the coverage report plus `status` and, when published, the record."""
    folder = state.path("curricula", partition)
    candidate = curriculum_lib.read_candidate(folder)
    version = candidate["version"] if candidate else curriculum_lib.current_version(folder)
    if version is None:
        return {"partition": partition, "passed": True, "status": "no curriculum yet",
                "reason": f"nothing to check: materialize curriculum for {partition}"}
    try:
        examples = shards.load_shards(state.path("shards", partition))
        report = curriculum_lib.coverage_report(
            examples, curriculum_lib.load_curriculum(folder, version))
    except (FileNotFoundError, ValueError) as error:
        report = {"partition": partition, "version": version, "passed": False,
                  "failures": [str(error)], "reason": str(error)}
    if candidate is None:
        report["status"] = "current version re-checked"
        return report
    if not report["passed"]:
        curriculum_lib.reject_candidate(folder, version, report["failures"])
        report["status"] = (f"candidate {version} rejected; current stays "
                            f"{curriculum_lib.current_version(folder) or 'none'}")
        return report
    record = curriculum_lib.promote_candidate(folder, version, approved_by=approved_by)
    report["status"] = f"candidate {version} published (was {record['from'] or 'none'})"
    report["published"] = record
    if record.get("live_change"):
        report["live_change"] = slow_tick.apply_live_change(
            state.path(), partition, record["live_change"], version)
    return report


def _metadata(report: dict) -> dict:
    return {k: (json.dumps(v) if isinstance(v, (dict, list)) else v)
            for k, v in report.items() if v is not None}


def _curriculum_coverage(
    context: dg.AssetCheckExecutionContext, state: StateResource
) -> dg.AssetCheckResult:
    """Gate: the candidate keeps data from every shard (and class) and a sane share; passing
    publishes it, failing keeps the previous current version (and the candidate, for a look)."""
    approved_by = f"curriculum_coverage (dagster run {context.run.run_id[:8]})"
    reports = [audit_partition(state, p, approved_by) for p in _checked_partitions(context)]
    passed = all(r["passed"] for r in reports)
    if len(reports) == 1:
        metadata = _metadata(reports[0])
    else:  # a range: one row and one JSON entry per partition, never mixed
        rows = "\n".join(f"| {r['partition']} | {r.get('version', '-')} | {r['passed']} | "
                         f"{r['status']} |" for r in reports)
        metadata = {"partitions": dg.MetadataValue.md(
            "| partition | version | passed | status |\n|---|---|---|---|\n" + rows)}
        metadata.update({f"{r['partition']}": dg.MetadataValue.json(r) for r in reports})
    return dg.AssetCheckResult(passed=passed, severity=dg.AssetCheckSeverity.ERROR,
                               metadata=metadata,
                               description="; ".join(f"{r['partition']}: {r['status']}"
                                                     for r in reports))


# A partitioned check (Dagster 1.13: partitions_def on the check) records each verdict against
# its partition, so the UI shows per-partition status instead of "-". Dagster marks the
# parameter as preview; the warning is silenced here only, with this note as the reason.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=dg.PreviewWarning,
                            message=".*partitions_def on an AssetCheckSpec")
    curriculum_coverage = dg.asset_check(
        asset=curriculum, name="curriculum_coverage", blocking=True,
        partitions_def=data_partitions)(_curriculum_coverage)
