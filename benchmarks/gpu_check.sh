#!/usr/bin/env bash
# The GPU check of issue 26 (benchmarks/gpu_check.py): one accelerator, under five minutes.
# Writes benchmarks/results/gpu.{json,md}. Needs the project's venv (make venv) with a CUDA
# build of torch 2.13 on that machine; nothing is downloaded (the model is built from a config).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no GPU (torch ' + torch.__version__ + ')')"
exec timeout 290 "$PY" -m benchmarks.gpu_check "$@"
