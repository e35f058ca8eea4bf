"""Peak RSS and time of a loop that enters several workspaces in turn, one per layer of a 12-layer
tanh network (a workspace per layer name, as a user porting DL4J code may write it), against plain
NumPy, in fresh processes, alternated.
``python benches/many_workspaces.py [--runs N] [--workspaces K ...]``

A workspace entered in turn with others hands its region on once nothing lives in it (the lot,
``rust/core/src/lot.rs``): two regions serve the layers, the one holding the last layer's output
and the one the next layer carves in, where NumPy's heap serves every layer from the same freed
blocks. One workspace for the layers' working memory (as ``LayerWorkspaceMgr`` places it) holds one.
"""

import argparse
import contextlib
import resource
import statistics
import subprocess
import sys
import time


def run_one(workspaces: int) -> None:
    """Runs the loop in this process (``workspaces`` 0: plain) and prints its figures as one line."""
    import numpy as np

    ws = None
    if workspaces:
        import rustws

        ws = [rustws.workspace(f"layer{i}") for i in range(workspaces)]
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((256, 256)) * 0.06 for _ in range(12)]
    x0 = rng.standard_normal((1024, 256))  # 2 MiB activations
    t = time.perf_counter()
    for _ in range(100):
        x = x0
        for i, w in enumerate(weights):
            with ws[i % workspaces] if ws else contextlib.nullcontext():
                x = np.tanh(x @ w) + 0.01 * x
    elapsed = time.perf_counter() - t
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    minflt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(f"{hwm / 1024:.1f} {minflt} {elapsed:.3f} {float(x.sum()):.9e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workspaces", type=int, nargs="*", default=[1, 4, 12])
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        run_one(args.one)
        return
    if any(k < 1 for k in args.workspaces):
        p.error("--workspaces takes counts of 1 or more")
    variants = [0, *args.workspaces]
    rows: dict[int, list[list[str]]] = {k: [] for k in variants}
    for _ in range(args.runs):
        for k in variants:
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(k)], capture_output=True, text=True, check=True
            ).stdout.split()
            rows[k].append(out)
    sums = {row[3] for k in variants for row in rows[k]}
    print("workspaces  peak RSS MiB  faults  time s  RSS / plain")
    plain = statistics.median(float(r[0]) for r in rows[0])
    for k in variants:
        rss = statistics.median(float(r[0]) for r in rows[k])
        faults = int(statistics.median(int(r[1]) for r in rows[k]))
        secs = statistics.median(float(r[2]) for r in rows[k])
        name = "plain" if k == 0 else str(k)
        print(f"{name:>10}  {rss:12.1f}  {faults:6d}  {secs:6.3f}  {rss / plain:10.2f}")
    print("results identical" if len(sums) == 1 else f"results differ: {sorted(sums)}")


if __name__ == "__main__":
    main()
