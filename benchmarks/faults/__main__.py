"""`python -m benchmarks.faults [--quick] [--out DIR] [--work-dir DIR] [--seed N]`."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks import results_io
from benchmarks.faults import report
from benchmarks.faults.suite import run_suite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="7 trials instead of 36 (about 2 minutes)")
    parser.add_argument("--out", default=str(results_io.PROJECT_ROOT / "benchmarks" / "results"),
                        help="folder of faults.{md,json} (default: benchmarks/results)")
    parser.add_argument("--work-dir", default=None,
                        help="folder for the trial runs (default: a temporary one, removed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault points")
    args = parser.parse_args(argv)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="faults-"))
    try:
        payload = run_suite(work, quick=args.quick, seed=args.seed)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    command = [Path(sys.executable).name, "-m", "benchmarks.faults", *(argv or sys.argv[1:])]
    json_path, md_path = results_io.write_results(
        args.out, "faults", payload, report.markdown(payload),
        meta=results_io.provenance(command))
    print(f"wrote {json_path} and {md_path}")
    figures = payload["figures"]
    print(f"corrupt checkpoints {figures['corrupt_checkpoints']}, failed resumes "
          f"{figures['failed_resumes']}, rows lost/duplicated {figures['rows_lost']}/"
          f"{figures['rows_duplicated']}, code executed from files "
          f"{figures['code_executed_from_files']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
