"""A small Hugging Face Trainer job under trainwise: a GPT-2-style character model on Shakespeare.

    python examples/hf_trainer/train.py --run-dir /tmp/hf-run --store-root /tmp/hf-store

The model is `transformers.GPT2LMHeadModel` built from a `GPT2Config` (2 layers, 64 wide, random
initial weights: nothing is downloaded) over a byte-level vocabulary (each UTF-8 byte is a token,
so no tokenizer is needed), trained with the `Trainer` on a `datasets.Dataset` of the passages in
data/passages.jsonl. Run it again with the same arguments after a SIGTERM (exit code 143) and it
resumes where the notice stopped it, mid-epoch, ending with the weights an uninterrupted run ends
with. Under a launcher (TRAINWISE_RUN_SPEC set) the spec names the run, its folders and its
registered dataset (`run.dataset()`); the arguments given here override the spec's fields.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import datasets
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from trainwise.sdk.hf import TrainwiseCallback, TrainwiseTrainer

HERE = Path(__file__).resolve().parent
CONTEXT = 64  # characters (bytes) per example: the model's n_positions
PAD = 0  # the NUL byte pads a short passage; its labels are -100 (no loss)


def encode(batch: dict) -> dict:
    """Byte-level tokens: a passage's UTF-8 bytes, cut or padded to CONTEXT."""
    input_ids, labels = [], []
    for text in batch["text"]:
        ids = list(text.encode("utf-8"))[:CONTEXT]
        short = CONTEXT - len(ids)
        input_ids.append(ids + [PAD] * short)
        labels.append(ids + [-100] * short)
    return {"input_ids": input_ids, "labels": labels}


def local_splits(path: Path) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The data file as `datasets` rows with `example_id` (the passage id, as the platform's
    shards give it); 10% held out (passage_id % 10 == 0)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["example_id"] = row["passage_id"]
    return (datasets.Dataset.from_list([r for r in rows if r["passage_id"] % 10 != 0]),
            datasets.Dataset.from_list([r for r in rows if r["passage_id"] % 10 == 0]))


class PrintSteps(TrainerCallback):
    """The job's own progress line per step (a test waits for it before its SIGTERM)."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def on_step_end(self, args, state, control, **kwargs):
        print(f"step {state.global_step} epoch {state.epoch:.4f}", flush=True)
        if self.sleep_s:
            time.sleep(self.sleep_s)  # a slower job, so that a notice lands mid-run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "data" / "passages.jsonl")
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--store-root", default=None)
    parser.add_argument("--notice-file", default=None)
    parser.add_argument("--max-steps", type=int, default=None, help="default 40 (a local run)")
    parser.add_argument("--checkpoint-every-steps", type=int, default=None,
                        help="default 10 (a local run)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--eval-every-steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; a bit-identical resume needs the same count each start")
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    launched = bool(os.environ.get("TRAINWISE_RUN_SPEC"))
    if not launched:  # a local run's defaults; under a launcher its spec says
        args.max_steps = args.max_steps or 40
        args.checkpoint_every_steps = args.checkpoint_every_steps or 10
    spec_fields = {"run_id": args.run_id, "run_dir": args.run_dir, "store_root": args.store_root,
                   "notice_file": args.notice_file, "max_steps": args.max_steps,
                   "checkpoint_every_steps": args.checkpoint_every_steps, "seed": args.seed}
    tw = TrainwiseCallback(**{k: v for k, v in spec_fields.items() if v is not None})
    seed = tw.run.spec.seed

    if tw.run.spec.dataset_dir:  # the registered dataset's shards, split by the platform
        train_rows, eval_rows = tw.run.dataset("train"), tw.run.dataset("eval")
    else:
        train_rows, eval_rows = local_splits(args.data)
    train_set = train_rows.map(encode, batched=True, keep_in_memory=True)
    eval_set = eval_rows.map(encode, batched=True, keep_in_memory=True)

    torch.manual_seed(seed)  # the initial weights (a resume loads the checkpoint's instead)
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the causal-LM loss, named (transformers warns otherwise)
    training_args = tw.training_args(
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64,
        gradient_accumulation_steps=args.grad_accum, learning_rate=3e-3, weight_decay=0.01,
        lr_scheduler_type="cosine", warmup_steps=4, eval_strategy="steps",
        eval_steps=args.eval_every_steps, logging_steps=10)
    trainer = TrainwiseTrainer(model=model, args=training_args, train_dataset=train_set,
                               eval_dataset=eval_set,
                               callbacks=[tw, PrintSteps(args.step_sleep_s)])
    print(f"resumed {tw.run.resumed} at step {tw.run.step_count}", flush=True)
    trainer.train()
    tw.raise_if_preempted()  # exit 143 after a notice: the launcher starts the job again
    print(f"finished at step {tw.run.step_count} eval_loss {tw.eval_value}", flush=True)


if __name__ == "__main__":
    main()
