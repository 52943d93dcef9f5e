"""A small PyTorch Lightning job under trainwise: an MLP regression on data/points.jsonl.

    python examples/lightning/train.py --run-dir /tmp/lit-run --store-root /tmp/lit-store

Run it again with the same arguments after a SIGTERM (exit code 143) and it resumes where the
notice stopped it, mid-epoch, ending with the weights an uninterrupted run ends with. Under a
launcher (TRAINWISE_RUN_SPEC set) the spec names the run and its folders; the arguments given
here override the spec's fields.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from trainwise.sdk.lightning import TrainwiseCallback

HERE = Path(__file__).resolve().parent


class Points(torch.utils.data.Dataset):
    """The rows of a points.jsonl; `dataset["point_id"]` gives trainwise the example ids."""

    column_names = ("point_id", "x", "y")

    def __init__(self, rows: list[dict]) -> None:
        self.ids = [row["point_id"] for row in rows]
        self.x = torch.tensor([row["x"] for row in rows], dtype=torch.float32)
        self.y = torch.tensor([[row["y"]] for row in rows], dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, key):
        if key == "point_id":
            return self.ids
        return self.x[key], self.y[key]


class Regressor(pl.LightningModule):
    def __init__(self, n_features: int, max_steps: int, hidden: int = 32) -> None:
        super().__init__()
        self.max_steps = max_steps
        self.net = torch.nn.Sequential(torch.nn.Linear(n_features, hidden), torch.nn.GELU(),
                                       torch.nn.Dropout(0.1),  # draws from torch's CPU generator
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                               T_max=max(1, self.max_steps))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PrintSteps(pl.Callback):
    """The job's own progress line per step (a test waits for it before its SIGTERM)."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"step {trainer.global_step} epoch {trainer.current_epoch} batch {batch_idx}",
              flush=True)
        if self.sleep_s:
            time.sleep(self.sleep_s)  # a slower job, so that a notice lands mid-run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "data" / "points.jsonl")
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--store-root", default=None)
    parser.add_argument("--notice-file", default=None)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--checkpoint-every-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; a bit-identical resume needs the same count each start")
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    spec_fields = {"run_id": args.run_id, "run_dir": args.run_dir, "store_root": args.store_root,
                   "notice_file": args.notice_file, "max_steps": args.max_steps,
                   "checkpoint_every_steps": args.checkpoint_every_steps, "seed": args.seed}
    tw = TrainwiseCallback(**{k: v for k, v in spec_fields.items() if v is not None})

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    train_rows = [row for row in rows if row["point_id"] % 10 != 0]  # 10% held out (eval_fraction)
    eval_rows = [row for row in rows if row["point_id"] % 10 == 0]
    loader = tw.dataloader(Points(train_rows), batch_size=args.batch_size, id_column="point_id")
    eval_set = Points(eval_rows)
    eval_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(eval_set.x, eval_set.y),
                                              batch_size=64)

    torch.manual_seed(args.seed)  # the initial weights (a resume loads the checkpoint's instead)
    model = Regressor(eval_set.x.shape[1], max_steps=tw.max_steps)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=tw.max_steps,
                         callbacks=[tw, PrintSteps(args.step_sleep_s)], logger=False,
                         enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    print(f"resumed {tw.run.resumed} at step {tw.run.step_count}", flush=True)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=eval_loader)
    tw.raise_if_preempted()  # exit 143 after a notice: the launcher starts the job again
    print(f"finished at step {tw.run.step_count}", flush=True)


if __name__ == "__main__":
    main()
