"""Data as assets: shards -> difficulty scores -> curriculum (with its gate)."""
import json

import dagster as dg

from assets.partitions import data_partitions
from assets.resources import StateResource
from training import curriculum as curriculum_lib
from training import scoring, shards
from trainwise import settings


class CurriculumConfig(dg.Config):
    """How much of the easy data to prune."""

    pruning_rate: float | None = None
    """Share of below-mean-loss examples dropped, in [0, 1); unset = TRAINWISE_PRUNING_RATE."""
    seed: int = 0
    """Seed of the pruning draw (the manifest is reproducible for a seed)."""


@dg.asset(partitions_def=data_partitions, group_name="data", kinds={"parquet"})
def data_shards(context: dg.AssetExecutionContext, state: StateResource) -> dg.MaterializeResult:
    """Parquet shards of one data set, written atomically, with a held-out eval split."""
    partition = context.partition_key
    manifest = shards.build_shards(partition, state.data_dir(), state.path("shards", partition))
    return dg.MaterializeResult(metadata=shards.manifest_metadata(manifest))


@dg.asset(partitions_def=data_partitions, group_name="data", deps=[data_shards])
def difficulty_scores(
    context: dg.AssetExecutionContext, state: StateResource
) -> dg.MaterializeResult:
    """Per-example loss under a small reference model (the data's difficulty)."""
    partition = context.partition_key
    examples = shards.load_shards(state.path("shards", partition))
    table = scoring.difficulty_scores(examples)
    scoring.write_scores(table, state.path("scores", partition))
    return dg.MaterializeResult(metadata=scoring.score_metadata(table))


@dg.asset(partitions_def=data_partitions, group_name="data", deps=[difficulty_scores])
def curriculum(
    context: dg.AssetExecutionContext, config: CurriculumConfig, state: StateResource
) -> dg.MaterializeResult:
    """A versioned manifest of the kept train examples and their loss weights."""
    partition = context.partition_key
    rate = (
        settings.pruning_rate()
        if config.pruning_rate is None
        else config.pruning_rate
    )
    examples = shards.load_shards(state.path("shards", partition))
    table = scoring.read_scores(state.path("scores", partition))
    built = curriculum_lib.build_curriculum(examples, table, rate, seed=config.seed)
    summary = curriculum_lib.summarize_curriculum(built, examples, table)
    path = curriculum_lib.write_curriculum(built, state.path("curricula", partition),
                                           summary=summary)
    kept = int(len(built.example_ids))
    train_total = int(len(examples.train_positions))
    return dg.MaterializeResult(
        metadata={
            "version": built.version,
            "pruning_rate": rate,
            "kept_examples": kept,
            "train_examples": train_total,
            "kept_share": kept / max(1, train_total),
            "manifest": dg.MetadataValue.path(str(path)),
        },
        tags={"trainwise/curriculum_version": built.version},
    )


@dg.asset_check(asset=curriculum, blocking=True)
def curriculum_coverage(
    context: dg.AssetCheckExecutionContext, state: StateResource
) -> dg.AssetCheckResult:
    """Gate: the curriculum keeps data from every shard (and every class) and a sane share."""
    partition = context.run.tags.get("dagster/partition", "")
    if not partition:
        return dg.AssetCheckResult(
            passed=False,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata={"reason": "run has no partition tag; launch the check for one data set"},
        )
    examples = shards.load_shards(state.path("shards", partition))
    built = curriculum_lib.load_curriculum(state.path("curricula", partition))
    report = curriculum_lib.coverage_report(examples, built)
    return dg.AssetCheckResult(
        passed=bool(report["passed"]),
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={k: (json.dumps(v) if isinstance(v, (dict, list)) else v)
                  for k, v in report.items()},
    )
