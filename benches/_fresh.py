"""Runs loops plainly and captured, each run in a fresh process, alternated, and prints the
medians of their peak RSS, page faults, system time and time: the driver of the benches whose
figures depend on a whole process (``kept_beside_large.py``, ``overlapping_cycles.py``).

A program is a function of one argument, the workspace (None when plain); ``cycle(ws)`` gives
the context manager of one cycle either way.
"""

import argparse
import contextlib
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

Program = Callable[[Any], None]


def cycle(ws: Any) -> contextlib.AbstractContextManager[Any]:
    """One cycle of `ws`, or nothing where plain."""
    return ws if ws is not None else contextlib.nullcontext()


def run_one(programs: dict[str, Program], program: str, mode: str, name: str) -> None:
    """Runs `program` in this process and prints its figures as one line."""
    ws = None
    if mode == "rustws":
        import rustws

        ws = rustws.workspace(name)
    t = time.perf_counter()
    programs[program](ws)
    elapsed = time.perf_counter() - t
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    print(f"{hwm / 1024:.1f} {ru.ru_minflt} {ru.ru_stime:.3f} {elapsed:.3f}")


def main(doc: str, script: str, programs: dict[str, Program], name: str) -> None:
    """The command line of a bench whose module doc is `doc` and whose file is `script`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("programs", nargs="*", default=list(programs))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--one", nargs=2, metavar=("PROGRAM", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        run_one(programs, *args.one, name)
        return
    unknown = sorted(set(args.programs) - set(programs))
    if unknown:
        p.error(f"unknown program(s) {', '.join(unknown)} (use {', '.join(programs)})")
    print("program     mode      peak RSS MB  faults  system s  time s")
    for program in args.programs:
        rows: dict[str, list[list[float]]] = {"plain": [], "rustws": []}
        for _ in range(args.runs):
            for mode in rows:
                cmd = [sys.executable, script, "--one", program, mode]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
                rows[mode].append([float(v) for v in out])
        for mode, runs in rows.items():
            med = [sorted(col)[len(col) // 2] for col in zip(*runs, strict=True)]
            print(f"{program:11s} {mode:7s} {med[0]:11.1f} {med[1]:7.0f} {med[2]:9.3f} {med[3]:7.3f}")
        peak = {mode: sorted(r[0] for r in runs)[len(runs) // 2] for mode, runs in rows.items()}
        took = {mode: sorted(r[3] for r in runs)[len(runs) // 2] for mode, runs in rows.items()}
        print(
            f"{program:11s} peak RSS {peak['rustws'] / peak['plain']:.2f}x plain, "
            f"time {took['rustws'] / took['plain']:.2f}x"
        )
