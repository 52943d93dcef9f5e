"""A plain PyTorch loop under trainwise: a 3-class MLP on data/blobs.jsonl, in four calls.

    python examples/plain_loop/train.py --run-dir /tmp/plain-run --store-root /tmp/plain-store

A SIGTERM (or the node agent's notice file) makes `run.step` commit a checkpoint and leave with
exit code 143; the same command again resumes mid-epoch and ends with the weights an
uninterrupted run ends with. Under a launcher (TRAINWISE_RUN_SPEC set) the spec names the run and
its folders; the arguments given here override the spec's fields.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import trainwise

HERE = Path(__file__).resolve().parent


class Blobs(torch.utils.data.Dataset):
    """The rows of a blobs.jsonl; `dataset["row_id"]` gives trainwise the example ids."""

    column_names = ("row_id", "features", "label")

    def __init__(self, rows: list[dict]) -> None:
        self.ids = [row["row_id"] for row in rows]
        self.x = torch.tensor([row["features"] for row in rows], dtype=torch.float32)
        self.y = torch.tensor([row["label"] for row in rows], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, key):
        if key == "row_id":
            return self.ids
        return self.x[key], self.y[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "data" / "blobs.jsonl")
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
    parser.add_argument("--step-sleep-s", type=float, default=0.0,
                        help="a slower job, so that a notice lands mid-run")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    spec_fields = {"run_id": args.run_id, "run_dir": args.run_dir, "store_root": args.store_root,
                   "notice_file": args.notice_file, "max_steps": args.max_steps,
                   "checkpoint_every_steps": args.checkpoint_every_steps, "seed": args.seed}
    run = trainwise.init(**{k: v for k, v in spec_fields.items() if v is not None})

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    train = Blobs([row for row in rows if row["row_id"] % 10 != 0])  # 10% held out
    held_out = Blobs([row for row in rows if row["row_id"] % 10 == 0])
    loader = run.dataloader(train, batch_size=args.batch_size, id_column="row_id")

    torch.manual_seed(args.seed)  # the initial weights (a resume loads the checkpoint's instead)
    model = torch.nn.Sequential(torch.nn.Linear(train.x.shape[1], 32), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.max_steps)
    model, optimizer = run.track(model, optimizer, scheduler=scheduler)
    print(f"resumed {run.resumed} at step {run.step_count}", flush=True)

    while not run.done:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.step(loss=loss, samples=len(x))  # a notice leaves here: Preempted, exit 143
            print(f"step {run.step_count}", flush=True)
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            if run.done:
                break

    model.eval()
    with torch.no_grad():
        eval_loss = float(torch.nn.functional.cross_entropy(model(held_out.x), held_out.y))
    run.finish(eval_loss=eval_loss)
    print(f"finished at step {run.step_count} eval_loss {eval_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
