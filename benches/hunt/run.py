"""The fifth independent hunt's programs, plainly and captured: results and peak RSS.

``python benches/hunt/run.py [--runs N] [PROGRAM ...]`` runs each program (by default every
``p*.py`` here) plainly and captured, ``N`` times each (default 3), alternated, in fresh processes
with one BLAS thread, and prints the median peak RSS of each mode and their ratio, whether every run
gave the same results (a hash of everything the program computed), and any ``np.zeros`` found not
zero, kept array found changed or run that failed. It exits non-zero on any of those.

Each program is a loop a user would write with arrays of 128 KiB to 50 MB in neighbouring size
classes (off-by-one shapes, ``np.diff`` with ``prepend``, a table grown by a row, ``resize`` across
classes, ``np.fromiter``, masks and ``np.unique``, scikit-learn on two threads, asyncio tasks, images
of changing shapes, ``np.zeros`` beside neighbouring classes); ``common.py`` chooses real workspaces
(``MODE=captured``) or stand-ins (``MODE=plain``) and prints one ``RESULT`` line of JSON. ``p02`` and
``p09`` need SciPy, ``p07`` and ``p09`` scikit-learn.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(program: Path, mode: str) -> tuple[int, dict | None, str]:
    env = dict(os.environ, MODE=mode, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    got = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, text=True, cwd=HERE)
    result = None
    for line in got.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return got.returncode, result, got.stderr[-2000:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("programs", nargs="*", help="program files (default: every p*.py here)")
    p.add_argument("--runs", type=int, default=3, help="runs of each program and mode (median reported)")
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    programs = [Path(x).resolve() for x in args.programs] or sorted(HERE.glob("p[0-9]*.py"))
    failed = False
    print(f"{'program':24s} {'plain MB':>9s} {'captured MB':>12s} {'ratio':>6s}  results")
    for program in programs:
        runs: dict[str, list[dict]] = {"plain": [], "captured": []}
        problems = []
        for _ in range(args.runs):
            for mode, got in runs.items():
                rc, result, err = run(program, mode)
                if rc != 0 or result is None:
                    problems.append(f"{mode} run failed (exit {rc}): {err.strip()[-400:]}")
                    continue
                got.append(result)
                for key in ("zero_errors", "kept_errors", "thread_errors"):
                    problems += [f"{mode}: {e}" for e in result.get(key) or []]
        hashes = {r["hash"] for got in runs.values() for r in got}
        if len(hashes) > 1:
            problems.append(f"results differ between runs: {sorted(hashes)}")
        if not all(runs.values()):
            print(f"{program.name:24s} no result: {problems[:2]}")
            failed = True
            continue
        peak = {mode: sorted(r["hwm_kb"] for r in got)[len(got) // 2] / 1000 for mode, got in runs.items()}
        verdict = "identical" if not problems else "; ".join(problems[:3])
        print(
            f"{program.name:24s} {peak['plain']:9.1f} {peak['captured']:12.1f} "
            f"{peak['captured'] / peak['plain']:6.3f}  {verdict}",
            flush=True,
        )
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
