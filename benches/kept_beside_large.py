"""Peak RSS, page faults and time of loops whose cycles keep blocks beside large ones, each run
plainly and captured (`with rustws.workspace(...)` per cycle) in fresh processes, alternated.
``python benches/kept_beside_large.py [--runs N] [PROGRAM ...]``

- ``periodic``: a large cycle (three 48 MB arrays) every 25 cycles among cycles of random sizes
  (0.4-3.2 MB), a view of a result kept every 7th cycle for 28 cycles;
- ``zeros``: cycles of 8 B, 80 B, a 400 MB ``np.zeros`` written every 800 KB, 8 KB, a 96 MB
  ``np.zeros`` beside 48 MB temporaries whose sorted result is kept (through a view) for two
  rounds, and nothing, repeated;
- ``zeros-full``: a 64 MB ``np.zeros`` written in full every cycle.

Python keeps a loop body's variables past its ``with``: the last cycle's arrays live into the
next one, as in any loop, and so do the kept views' blocks.
"""

import argparse
import contextlib
import resource
import subprocess
import sys
import time

import numpy as np


def periodic(cycle) -> None:
    rng = np.random.default_rng(3)
    kept = []
    for i in range(400):
        with cycle():
            n = 6_000_000 if i % 25 == 0 else int(rng.integers(50_000, 400_000))
            a = rng.standard_normal(n)
            b = np.cumsum(a)
            c = b * 0.5 + a
            if i % 7 == 0:
                kept.append(c[::3])
            if len(kept) > 4:
                kept.pop(0)


def zeros(cycle) -> None:
    rng = np.random.default_rng(2)
    kept = []
    for _ in range(6):
        for kind in range(6):
            with cycle():
                if kind in (0, 1, 3):
                    x = np.ones((1, 10, 0, 1000)[kind])
                elif kind == 2:
                    z = np.zeros(50_000_000)
                    z[::100_000] = 1.0
                elif kind == 4:
                    z = np.zeros(12_000_000)
                    a = rng.standard_normal(6_000_000)
                    b = a * 2
                    c = b + z[:6_000_000]
                    kept.append(np.sort(c)[10:])
                    if len(kept) > 2:
                        kept.pop(0)
    del x, z


def zeros_full(cycle) -> None:
    x = np.ones(8_000_000)
    for _ in range(60):
        with cycle():
            acc = np.zeros(8_000_000)
            acc += x
            y = acc * 2
            float(y.sum())


PROGRAMS = {"periodic": periodic, "zeros": zeros, "zeros-full": zeros_full}


def run_one(program: str, mode: str) -> None:
    """Runs `program` in this process and prints its figures as one line."""
    if mode == "plain":

        def cycle():
            return contextlib.nullcontext()
    else:
        import rustws

        ws = rustws.workspace("KEPT")

        def cycle():
            return ws

    t = time.perf_counter()
    PROGRAMS[program](cycle)
    elapsed = time.perf_counter() - t
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    print(f"{hwm / 1024:.1f} {ru.ru_minflt} {ru.ru_stime:.3f} {elapsed:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("programs", nargs="*", default=list(PROGRAMS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--one", nargs=2, metavar=("PROGRAM", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        run_one(*args.one)
        return
    print("program     mode      peak RSS MB  faults  system s  time s")
    for program in args.programs:
        rows = {"plain": [], "rustws": []}
        for _ in range(args.runs):
            for mode in rows:
                cmd = [sys.executable, __file__, "--one", program, mode]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
                rows[mode].append([float(v) for v in out])
        for mode, runs in rows.items():
            med = [sorted(col)[len(col) // 2] for col in zip(*runs, strict=True)]
            print(f"{program:11s} {mode:7s} {med[0]:11.1f} {med[1]:7.0f} {med[2]:9.3f} {med[3]:7.3f}")
        peak = {mode: sorted(r[0] for r in runs)[len(runs) // 2] for mode, runs in rows.items()}
        ratio = peak["rustws"] / peak["plain"]
        print(f"{program:11s} peak RSS {ratio:.2f}x plain")


if __name__ == "__main__":
    main()
