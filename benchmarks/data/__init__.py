"""`python -m benchmarks.data` (or `trainwise bench data`): the data-selection suite.

Full data, random pruning, InfoBatch and trainwise's slow-policy pruning, at the same budget, on
the char GPT (tinyshakespeare) and the CNN (MNIST), 3 seeds each; writes
`benchmarks/results/data.md`, `data.json`, `data_eval_loss_vs_samples.png` and
`pruning_calibration.json`. See `suite.py` for the settings, `report.py` for the figures.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the suite (imported lazily so `python -m benchmarks.data` imports it only once)."""
    from benchmarks.data.__main__ import main as run

    return run(argv)
