"""Jobs: the whole chain (demo) and the training run alone (train)."""

import dagster as dg

demo_job = dg.define_asset_job(
    "demo",
    selection=dg.AssetSelection.groups("data", "training"),
    description="Shards -> difficulty scores -> curriculum (gated) -> training run with MLflow.",
)

train_job = dg.define_asset_job(
    "train",
    selection=dg.AssetSelection.assets("checkpoint"),
    description="Train from the current curriculum and record cost vs eval loss.",
)

curriculum_job = dg.define_asset_job(
    "curriculum_refresh",
    selection=dg.AssetSelection.assets("difficulty_scores", "curriculum"),
    description="Re-score the data and rebuild the curriculum (what the slow-policy sensor asks).",
)
