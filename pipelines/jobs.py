"""Jobs: the whole chain (demo) and the training run alone (train)."""

import dagster as dg

from assets.partitions import data_partitions

demo_job = dg.define_asset_job(
    "demo",
    selection=dg.AssetSelection.groups("data", "training"),
    partitions_def=data_partitions,
    description="Shards -> difficulty scores -> curriculum (gated) -> training run with MLflow.",
)

train_job = dg.define_asset_job(
    "train",
    selection=dg.AssetSelection.assets("checkpoint"),
    partitions_def=data_partitions,
    description="Train from the current curriculum and record cost vs eval loss.",
)
