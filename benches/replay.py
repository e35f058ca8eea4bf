"""Recorded allocation traces replayed plainly and captured: peak RSS from placement alone.

``python benches/replay.py [--runs N] [TRACE ...]`` replays each trace (by default every one in
``benches/traces``) in fresh processes, plainly and inside a workspace, alternated, and prints the
median peak RSS of each, their ratio, and the geometric mean and the largest ratio over the traces.

``python benches/replay.py --record OUT [--workspace NAME] PROGRAM [ARGS ...]`` runs the Python file
PROGRAM with ARGS under ``rustws.memory.record_history()`` and writes what one workspace handed out
and took back, with its cycles' opens and closes, to OUT (gzip-compressed where it ends in ``.gz``).

A trace holds the requests a workspace served (those below its ``helper_min_size`` pass to NumPy's
allocator and are not in it) in the order they came. Replayed, each one is a NumPy array of that
many bytes with every page written, freed where the program freed it, so both runs make the same
blocks at the same moments and touch all of them: the difference in peak RSS is where the blocks
were placed and what the workspace kept resident, not which pages the program happened to write.
A replay takes about a second where its program takes minutes, and it is deterministic, so
placement rules can be compared over many loops in one sitting. What it leaves out: threads and
tasks (a trace is one workspace's, replayed on one thread with its cycles nested, not
overlapping), pages a program never writes, and `realloc` (recorded as a new block and a free).

Each trace in ``benches/traces`` names the program it was recorded from in its first line; the
programs of the fifth hunt are in ``benches/hunt`` (run with ``MODE=captured``).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import resource
import runpy
import subprocess
import sys
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
TRACES = HERE / "traces"


def _open(path: str | Path, mode: str) -> IO[str]:
    if str(path).endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="ascii")
    return open(path, mode, encoding="ascii")


def record(out: str, workspace: str | None, argv: list[str]) -> None:
    """Runs the program ``argv[0]`` with ``argv[1:]`` and writes one workspace's trace to ``out``."""
    import rustws.memory

    program = Path(argv[0]).resolve()
    rustws.memory.record_history(max_entries=10_000_000, stacks=None)
    sys.argv = [str(program), *argv[1:]]
    sys.path.insert(0, str(program.parent))
    try:
        runpy.run_path(str(program), run_name="__main__")
    finally:
        snap = rustws.memory.snapshot()
    recorded = [w for w in snap["workspaces"] if w["events"]]
    if workspace is not None:
        recorded = [w for w in recorded if w["name"] == workspace]
    if len(recorded) != 1:
        names = sorted({w["name"] for w in snap["workspaces"] if w["events"]})
        raise SystemExit(
            f"--record: {len(recorded)} workspaces recorded ({names}): name one with --workspace"
        )
    chosen = recorded[0]
    if chosen["dropped"]:
        raise SystemExit(f"--record: {chosen['dropped']} events were dropped: the trace would be incomplete")
    events = [e for t in snap["device_traces"] for e in t if e["workspace_id"] == chosen["id"]]
    with _open(out, "w") as f:
        f.write(f"# {' '.join([program.name, *argv[1:]])}, workspace {chosen['name']}\n")
        for e in events:
            if e["action"] in ("alloc", "free_completed"):
                f.write(f"{e['action'][0]} {e['addr']} {e['size']}\n")
            elif e["action"] in ("cycle_open", "cycle_close"):
                f.write(e["action"] + "\n")


def replay_one(trace: str, mode: str) -> None:
    """Replays ``trace`` in this process (``mode``: ``plain`` or ``captured``) and prints its figures
    as one JSON line."""
    import numpy as np

    ws = None
    if mode == "captured":
        import rustws

        ws = rustws.workspace("REPLAY")
    scope = ws if ws is not None else contextlib.nullcontext()
    live: dict[str, object] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    with _open(trace, "r") as f:
        for line in f:
            word = line.split()
            if not word or word[0].startswith("#"):
                continue
            if word[0] == "cycle_open":
                scope.__enter__()
            elif word[0] == "cycle_close":
                scope.__exit__(None, None, None)
            elif word[0] == "a":
                a = np.empty(int(word[2]), np.uint8)
                a[::page] = 1
                a[-1:] = 1
                live[word[1]] = a
            elif word[0] == "f":
                live.pop(word[1], None)
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    figures = {"hwm_kib": hwm, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}
    if ws is not None:
        stats = ws.stats()
        figures |= {"spills": stats.spill_count, "capacity_mib": stats.capacity_bytes >> 20}
    print(json.dumps(figures))


def compare(traces: list[Path], runs: int) -> None:
    """Replays every trace plainly and captured ``runs`` times each, alternated, in fresh processes."""
    print(f"{'trace':24s} {'plain MiB':>10s} {'captured MiB':>13s} {'ratio':>6s} {'faults':>15s} spills")
    ratios = []
    for trace in traces:
        rows: dict[str, list[dict[str, int]]] = {"plain": [], "captured": []}
        for _ in range(runs):
            for mode, got in rows.items():
                cmd = [sys.executable, __file__, "--one", str(trace), mode]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                got.append(json.loads(out.splitlines()[-1]))
        med = {
            mode: {k: sorted(r[k] for r in got)[len(got) // 2] for k in got[0]} for mode, got in rows.items()
        }
        plain, captured = med["plain"], med["captured"]
        ratio = captured["hwm_kib"] / plain["hwm_kib"]
        ratios.append(ratio)
        name = trace.name.removesuffix(".gz").removesuffix(".txt")
        print(
            f"{name:24s} {plain['hwm_kib'] / 1024:10.1f} {captured['hwm_kib'] / 1024:13.1f} {ratio:6.3f} "
            f"{captured['faults']:7d}/{plain['faults']:<7d} {captured['spills']:6d}",
            flush=True,
        )
    if ratios:
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(
            f"captured / plain peak RSS, {len(ratios)} traces: geomean {geomean:.3f}, max {max(ratios):.3f}"
        )


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--record"]:
        # The program's own arguments follow it verbatim, options included.
        r = argparse.ArgumentParser(prog="replay.py --record", description="record a program's trace")
        r.add_argument("out", metavar="OUT")
        r.add_argument("--workspace", help="the name of the workspace to record, where several were used")
        r.add_argument("program", metavar="PROGRAM")
        r.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
        a = r.parse_args(argv[1:])
        record(a.out, a.workspace, [a.program, *a.args])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="*", help="trace files (default: every one in benches/traces)")
    p.add_argument("--runs", type=int, default=1, help="runs of each trace and mode (median reported)")
    p.add_argument("--one", nargs=2, metavar=("TRACE", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        replay_one(*args.one)
        return
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    traces = [Path(t) for t in args.traces] or sorted(TRACES.glob("*.txt*"))
    if not traces:
        p.error(f"no traces given and none in {TRACES}")
    compare(traces, args.runs)


if __name__ == "__main__":
    main()
