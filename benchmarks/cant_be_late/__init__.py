"""The Can't Be Late setting (Wu et al., NSDI'24), exactly, and parity with its published
simulator window by window: `python -m benchmarks.cant_be_late [--quick]`. See `scenario.py`
for every accounting convention."""
