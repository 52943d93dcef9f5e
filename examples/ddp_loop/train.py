"""A plain DistributedDataParallel loop under trainwise: a 3-class MLP on two CPU ranks (gloo).

    torchrun --standalone --nproc-per-node 2 examples/ddp_loop/train.py \\
        --run-dir /tmp/ddp-run --store-root /tmp/ddp-store

`trainwise.init()` joins the ranks' process group (gloo here, nccl on GPUs); `run.dataloader`
gives each rank its slice of every global batch; `run.ddp(model)` wraps the model. A SIGTERM to
any one rank (or the node agent's notice file) makes every rank commit its checkpoint of the same
step and leave with exit code 143; the same command resumes all ranks from the newest step every
rank committed and ends with the weights an uninterrupted run ends with. Run alone (no torchrun)
it is one process, with the same code.

The data is made here, the same on every machine: 96 rows (numpy's PCG64 from a fixed seed), so
an epoch is 6 global batches of 8 rows x 2 ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import trainwise

N_ROWS, N_FEATURES, N_CLASSES = 96, 4, 3


def blobs(seed: int = 7) -> torch.utils.data.TensorDataset:
    generator = np.random.Generator(np.random.PCG64(seed))
    centres = generator.normal(scale=2.0, size=(N_CLASSES, N_FEATURES))
    labels = generator.integers(0, N_CLASSES, size=N_ROWS)
    x = centres[labels] + generator.normal(size=(N_ROWS, N_FEATURES))
    return torch.utils.data.TensorDataset(torch.tensor(x, dtype=torch.float32),
                                          torch.tensor(labels, dtype=torch.long))


def say(text: str) -> None:
    # One write per line: the ranks share torchrun's stdout, and a print's pieces interleave.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--store-root", default=None)
    parser.add_argument("--notice-file", default=None)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--checkpoint-every-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--step-sleep-s", type=float, default=0.0,
                        help="a slower job, so that a notice lands mid-run")
    args = parser.parse_args()

    torch.set_num_threads(1)  # a bit-identical resume needs the same count in every start
    spec_fields = {"run_id": args.run_id, "run_dir": args.run_dir, "store_root": args.store_root,
                   "notice_file": args.notice_file, "max_steps": args.max_steps,
                   "checkpoint_every_steps": args.checkpoint_every_steps, "seed": args.seed,
                   "device": "cpu"}
    run = trainwise.init(**{k: v for k, v in spec_fields.items() if v is not None})
    loader = run.dataloader(blobs(), batch_size=args.batch_size, id_column=None)

    torch.manual_seed(args.seed)  # the initial weights (a resume loads the checkpoint's instead)
    model = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 32), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, N_CLASSES))
    model = run.ddp(model)  # DistributedDataParallel under torchrun, the model itself alone
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.max_steps)
    model, optimizer = run.track(model, optimizer, scheduler=scheduler)  # saves the inner module
    say(f"rank {run.rank} pid {os.getpid()} resumed {run.resumed} at step {run.step_count}")

    while not run.done:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the ranks' gradients here
            optimizer.step()
            scheduler.step()
            run.step(loss=loss, samples=len(x))  # the ranks agree on a notice; exit 143 here
            if run.rank == 0:
                say(f"step {run.step_count}")
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            if run.done:
                break

    inner = getattr(model, "module", model)  # evaluated on each rank alone: no collective
    inner.eval()
    with torch.no_grad():
        x, y = blobs().tensors
        eval_loss = float(torch.nn.functional.cross_entropy(inner(x), y))
    run.finish(eval_loss=eval_loss)  # last: it destroys the process group the SDK made
    if run.rank == 0:
        say(f"finished at step {run.step_count} eval_loss {eval_loss:.4f}")


if __name__ == "__main__":
    main()
