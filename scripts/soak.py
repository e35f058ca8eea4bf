"""Soak: many cycles with escapes on several threads, resident memory sampled as it runs.

Each thread runs its own workspace through ``--cycles`` cycles of captured temporaries, explicit
allocations, a sort and a reduction; every ``--escape-every``-th cycle one array escapes and is
kept (the last few are held, older ones die), and kept arrays are checked for their contents. A
sampler thread reads the resident set size. At the end the script fails (exit 1) if a kept array
lost its contents or the resident set grew by more than ``--max-growth-mib`` after the first
tenth of the run (the workspaces have learned their size by then).

    .venv/bin/python scripts/soak.py                      # 10^6 cycles over 4 threads
    .venv/bin/python scripts/soak.py --cycles 20000       # the short form CI runs
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import numpy as np

import rustws


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def worker(index: int, cycles: int, escape_every: int, errors: list[str], done: list[int]) -> None:
    ws = rustws.workspace(f"SOAK-{index}")
    kept: collections.deque[tuple[np.ndarray, float]] = collections.deque(maxlen=8)
    x = np.arange(512, dtype=np.float64)
    try:
        for i in range(cycles):
            with ws:
                a = np.sin(x) * i  # captured temporaries
                b = ws.empty(256)
                np.multiply(a[:256], 2.0, out=b)
                c = np.sort(b)[::-1] + a[::2].sum()
                if i % escape_every == 0:
                    value = float(i)
                    e = ws.full(64, value)
                    kept.append((e, value))  # escapes its cycle
                del a, b, c
            if i % 997 == 0:
                for arr, value in kept:
                    if not (arr == value).all():
                        errors.append(f"thread {index}: a kept array lost its contents at cycle {i}")
                        return
            done[index] = i + 1
    except Exception as e:  # reported by the main thread
        errors.append(f"thread {index}: {e!r}")
    finally:
        kept.clear()
        ws.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=1_000_000, help="cycles in all, split over the threads")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--escape-every", type=int, default=10)
    parser.add_argument("--max-growth-mib", type=float, default=64.0)
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    args = parser.parse_args(argv)
    per_thread = max(1, args.cycles // args.threads)
    errors: list[str] = []
    done = [0] * args.threads
    threads = [
        threading.Thread(target=worker, args=(k, per_thread, args.escape_every, errors, done), daemon=True)
        for k in range(args.threads)
    ]
    samples: list[tuple[float, int, float]] = []
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append((time.perf_counter() - t0, sum(done), rss_mib()))
        time.sleep(args.interval)
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    samples.append((elapsed, sum(done), rss_mib()))
    total = sum(done)
    print(f"{total} cycles on {args.threads} threads in {elapsed:.1f} s ({total / elapsed:,.0f} cycles/s)")
    step = max(1, len(samples) // 10)
    for when, cycles, rss in samples[::step]:
        print(f"  t={when:7.2f} s  cycles={cycles:>9}  rss={rss:8.1f} MiB")
    settled = [rss for _, cycles, rss in samples if cycles >= total // 10] or [samples[-1][2]]
    growth = max(settled) - settled[0]
    print(
        f"resident set after the first tenth: {settled[0]:.1f} MiB, "
        f"peak {max(settled):.1f} MiB (+{growth:.1f})"
    )
    for e in errors:
        print("error:", e, file=sys.stderr)
    if errors:
        return 1
    if growth > args.max_growth_mib:
        print(
            f"error: the resident set grew by {growth:.1f} MiB (limit {args.max_growth_mib})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
