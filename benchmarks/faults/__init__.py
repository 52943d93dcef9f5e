"""The fault-injection suite: `python -m benchmarks.faults [--quick]`.

Real trainer processes (a small GPT on the tinyshakespeare shards, `trainwise.emulated_worker`)
are killed with SIGKILL at random steps, inside checkpoint writes and inside telemetry segment
seals, and sent SIGTERM at random steps. After each fault every committed checkpoint must load,
the run resumes to the end and must match an uninterrupted reference run bit for bit (one torch
thread), and its telemetry is ingested to count rows lost or duplicated. Around the trainer: a
full disk (a size-limited tmpfs), four concurrent ingestions, and hostile files (crafted
checkpoints, telemetry and spot traces) that must never run code.

Figures go to `benchmarks/results/faults.{md,json}` with their provenance
(`benchmarks.results_io`). Parts: `harness` (processes and checks), `trials` (one fault),
`hostile`, `environment` (disk, ingestion), `report`, and `suite` (runs them in order).
"""
