"""Side-by-side benchmarks: ``python -m rustws bench``.

Each (workload, variant) runs in a fresh process; variants are interleaved and repeated, and the
table reports medians and ratios from the same run. Variants: NumPy's default allocator, rustws
capture, the same code with preallocated ``out=`` buffers (the limit: no allocation at all), and
jemalloc, mimalloc and tcmalloc through ``LD_PRELOAD`` where installed.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ._progress import Progress

PEERS = {
    "jemalloc": "libjemalloc.so.2",
    "mimalloc": "libmimalloc.so.2",
    "tcmalloc": "libtcmalloc_minimal.so.4",
}
LIB_DIRS = [
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
]

# name -> (description, bytes per array or None, steps, quick steps)
WORKLOADS: dict[str, tuple[str, int | None, int, int]] = {
    "W1-1MiB": ("3 temporaries per step, float32, 1 MiB", 1 << 20, 300, 60),
    "W1-16MiB": ("3 temporaries per step, float32, 16 MiB", 16 << 20, 40, 12),
    "W1-64MiB": ("3 temporaries per step, float32, 64 MiB", 64 << 20, 16, 6),
    "W2-256B": ("3 temporaries per step, float32, 256 B", 256, 20000, 4000),
    "W2-4KiB": ("3 temporaries per step, float32, 4 KiB", 4096, 20000, 4000),
    "W2-mixed": (
        "3 temporaries per step at each of 64 B, 512 B, 2 KiB, 16 KiB (under and over 1 KiB), "
        "a cycle per step",
        None,
        8000,
        2000,
    ),
    "W3-SGD": ("SGD step, X 4096x1024 float32, weights escape every cycle", None, 60, 15),
    "W4-long": ("one long cycle around 100 steps of W1 at 1 MiB", 1 << 20, 3, 2),
    "W5-first": (
        "one long first cycle on a fresh workspace: 120 steps of mixed sizes 1 KiB-32 MiB, some kept",
        None,
        120,
        60,
    ),
    "W5-mixed": (
        "one long first cycle: 400 steps of log-uniform sizes 700 B-20 MB, the last six results kept",
        None,
        400,
        200,
    ),
    "W6-warmup": ("an empty first cycle, then 3 temporaries of 64 float32 per cycle", 256, 20000, 4000),
    "W7-keep": (
        "results.append(f(x)) per cycle: 160 KB temporaries, an 80 KB result kept, 1 thread",
        None,
        3000,
        600,
    ),
    "W7-pool4": ("W7 on a pool of 4 threads, each with its own workspace", None, 3000, 600),
    "W8-state": ("a step of 8 MB float32 temporaries with a state that escapes each cycle", 8 << 20, 60, 15),
    "W9-power": (
        "covariance X.T @ X of a 4096x512 float32 batch, then 16 normalised power iterations, "
        "a cycle per batch",
        None,
        60,
        15,
    ),
    "SKLEARN-fit": (
        "scikit-learn MLPClassifier((512, 512), batch 4000, 4 epochs) on 16000x256, fit in one cycle",
        None,
        1,
        1,
    ),
    "SPARSE-huge": (
        "per cycle: np.empty 3.6 GB and np.zeros 8 GiB, one corner of each written",
        None,
        4,
        2,
    ),
}
FAMILIES = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "SKLEARN", "SPARSE")
# Workloads with a hand-written no-allocation version (the limit).
WITH_LIMIT = ("W1", "W2", "W3", "W4", "W8", "W9")
# Steps timed together: the median is over chunks of this many (a cycle's own cost falls between
# steps, so each chunk times whole cycles).
CHUNKS = 20
WARMUP = 3


def _status_kib(field: str) -> int | None:
    """A KiB field of ``/proc/self/status`` (``VmPeak``, ``VmHWM``), None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux
        pass
    return None


def _vm_peak_kib() -> int:
    """This process's peak address space in KiB (``VmPeak``), 0 where /proc does not say."""
    return _status_kib("VmPeak") or 0


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _system_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def peak_rss_kib() -> int:
    """This process's peak resident set in KiB: ``VmHWM``, the high-water mark of its own address
    space. (``ru_maxrss`` survives ``exec``, so a child started by a large parent would report
    at least the parent's peak.)"""
    hwm = _status_kib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _w1_body(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    a = x * w
    b = a + 1
    return np.tanh(b)


def sklearn_available() -> bool:
    """Whether scikit-learn is installed (without importing it: the parent's size would show in
    every worker it starts)."""
    import importlib.util

    return importlib.util.find_spec("sklearn") is not None


def _first_cycle_workload(family: str, ws: Any, steps: int, steps_kind: str = "") -> tuple[Any, int, int]:
    """W5, SKLEARN and SPARSE, on a fresh workspace ``ws`` (None: plain NumPy): the function to
    time, the steps one call makes and the number of calls."""
    import contextlib

    def cycle() -> contextlib.AbstractContextManager[Any]:
        return ws if ws is not None else contextlib.nullcontext()

    if family == "W5" and steps_kind == "mixed":
        rng = np.random.default_rng(0)
        counts = (np.exp(rng.uniform(np.log(700), np.log(20e6), steps)) // 8).astype(int)
        big = np.random.default_rng(1).random(int(20e6) // 8)

        def run_mixed() -> None:
            with cycle():
                keep = []
                for n in counts:
                    x = big[:n]
                    t = x * 1.5
                    v = np.sqrt(t + 1.0) - t
                    keep.append(v)
                    if len(keep) > 6:
                        keep.pop(0)

        return run_mixed, steps, 1
    if family == "W5":
        sizes = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20]
        order = np.random.default_rng(0).choice(len(sizes), size=steps, p=[0.2, 0.2, 0.2, 0.15, 0.15, 0.1])
        src = np.random.default_rng(1).random((32 << 20) // 4, dtype=np.float32)

        def run() -> None:
            with cycle():
                keep = []
                for i, k in enumerate(order):
                    x = src[: sizes[k] // 4]
                    t = x * np.float32(1.5)
                    u = np.sqrt(t + np.float32(1.0))
                    v = u - t
                    if i % 5 == 0:  # some results live on, and are dropped later
                        keep.append(v)
                        if len(keep) > 6:
                            keep.pop(0)

        return run, steps, 1
    if family == "SKLEARN":
        import warnings

        from sklearn.neural_network import MLPClassifier

        rng = np.random.default_rng(0)
        X = rng.standard_normal((16000, 256)).astype(np.float32)
        y = rng.integers(0, 10, 16000)

        def run() -> None:
            clf = MLPClassifier(hidden_layer_sizes=(512, 512), batch_size=4000, max_iter=4, random_state=0)
            with warnings.catch_warnings(), cycle():
                warnings.simplefilter("ignore")
                clf.fit(X, y)

        return run, 1, 1

    # SPARSE: large arrays of which one corner is used, a cycle each
    def run_sparse() -> None:
        with cycle():
            e = np.empty(900_000_000, np.float32)
            e[:1024] = 1.0
            z = np.zeros(1 << 30)
            z[12345] = 1.0
            del e, z

    return run_sparse, 1, steps


def _keep_results(ws: Any, steps: int) -> list[np.ndarray]:
    """W7's loop, as a user writes it: each cycle keeps one result."""
    res = []
    k = np.float64(1.0)
    cycles = ws.cycles(range(steps)) if ws is not None else range(steps)
    for _ in cycles:
        a = np.ones(20000) * k
        res.append(a[::2].copy() + 0)
        k += 1
    return res


def _loop(ws: Any, body: Any) -> Any:
    """``loop(k)``: k steps of ``body``, each step one cycle of ``ws`` (the loop form), or plain."""
    if ws is None:

        def plain(k: int) -> None:
            for _ in range(k):
                body()

        return plain

    def cycles(k: int) -> None:
        for _ in ws.cycles(range(k)):
            body()

    return cycles


def _worker(workload: str, variant: str, steps: int) -> dict[str, Any]:
    """Runs one workload in this process and returns its measurements."""
    import rustws

    family = workload.split("-")[0]
    nbytes = WORKLOADS[workload][1]
    # Whatever the workload, the interpreter and NumPy's ufunc machinery are warm before timing.
    _w1_body(np.ones(16, np.float32), np.ones(16, np.float32))
    ws = rustws.workspace("BENCH") if variant == "rustws" else None
    extra: dict[str, Any] = {}
    if family == "W7":
        threads = 4 if workload.endswith("pool4") else 1
        f0, s0 = _faults(), _system_s()
        t0 = time.perf_counter()
        if threads == 1:
            kept = _keep_results(ws, steps)
        else:
            from concurrent.futures import ThreadPoolExecutor

            def work(n: int) -> list[np.ndarray]:
                own = rustws.workspace("BENCH") if variant == "rustws" else None
                return _keep_results(own, n)

            with ThreadPoolExecutor(threads) as pool:
                kept = [r for part in pool.map(work, [steps // threads] * threads) for r in part]
        elapsed = time.perf_counter() - t0
        out: dict[str, Any] = {
            "step_s": elapsed / steps,
            "faults_per_step": (_faults() - f0) / steps,
            "system_s_per_step": (_system_s() - s0) / steps,
            "peak_rss_kib": peak_rss_kib(),
            "vm_peak_kib": _vm_peak_kib(),
            "kept": len(kept),
        }
        if ws is not None:
            out["stats"] = ws.stats().as_dict()
        return out
    warmup = WARMUP
    repeat = steps
    per_call = 1
    loop: Any
    if family in ("W5", "SKLEARN", "SPARSE"):
        # First cycles on a fresh workspace: no warm-up; W5 and the fit are one cycle each.
        run, per_call, repeat = _first_cycle_workload(family, ws, steps, workload.split("-")[1])
        warmup = 0

        def first(k: int) -> None:
            for _ in range(k):
                run()

        loop = first
    elif workload == "W2-mixed":
        sizes = (64, 512, 2048, 16384)
        xs = [np.random.default_rng(k).random(n // 4, dtype=np.float32) for k, n in enumerate(sizes)]
        ws_ = [np.full(x.size, 0.5, np.float32) for x in xs]
        outs = [[np.empty(x.size, np.float32) for _ in range(3)] for x in xs] if variant == "limit" else []

        def mixed() -> None:
            for k in range(4):
                if variant == "limit":
                    o = outs[k]
                    np.multiply(xs[k], ws_[k], out=o[0])
                    np.add(o[0], 1, out=o[1])
                    np.tanh(o[1], out=o[2])
                else:
                    _w1_body(xs[k], ws_[k])

        loop = _loop(ws, mixed)
    elif family == "W9":
        rng = np.random.default_rng(0)
        X = rng.standard_normal((4096, 512), dtype=np.float32)
        v0 = rng.standard_normal(512, dtype=np.float32)
        C, v, u = np.empty((512, 512), np.float32), np.empty(512, np.float32), np.empty(512, np.float32)

        def power() -> None:
            if variant == "limit":
                np.matmul(X.T, X, out=C)
                v[:] = v0
                for _ in range(16):
                    np.matmul(C, v, out=u)
                    np.divide(u, np.linalg.norm(u), out=v)
            else:
                c = X.T @ X
                w = v0
                for _ in range(16):
                    z = c @ w
                    w = z / np.linalg.norm(z)

        loop = _loop(ws, power)
    elif family in ("W1", "W2", "W4", "W6"):
        assert nbytes is not None
        n = nbytes // 4
        x = np.random.default_rng(0).random(n, dtype=np.float32)
        w = np.full(n, 0.5, np.float32)
        bufs = [np.empty(n, np.float32) for _ in range(3)] if variant == "limit" else []

        def step() -> None:
            if variant == "limit":
                np.multiply(x, w, out=bufs[0])
                np.add(bufs[0], 1, out=bufs[1])
                np.tanh(bufs[1], out=bufs[2])
            else:
                _w1_body(x, w)

        if family == "W4":
            inner = 100
            per_call = inner

            def outer(k: int) -> None:
                for _ in range(k):
                    if ws is not None:
                        with ws:
                            for _ in range(inner):
                                step()
                    else:
                        for _ in range(inner):
                            step()

            loop = outer
        else:
            loop = _loop(ws, step)
        if family == "W6" and ws is not None:
            # The warm-up a user writes: a first cycle that allocates nothing.
            with ws:
                pass
            loop(3)
            extra["spills_after_cycle_3"] = ws.stats().spill_count
            warmup = 0
    elif family == "W8":
        assert nbytes is not None
        n = nbytes // 4
        x = np.random.default_rng(0).random(n, dtype=np.float32)
        half, quarter = np.float32(0.5), np.float32(0.25)
        st = {"s": np.zeros(n, np.float32), "spare": np.empty(n, np.float32)}
        t, u, v = (np.empty(n, np.float32) for _ in range(3)) if variant == "limit" else (None, None, None)

        def w8() -> None:
            if variant == "limit":
                np.multiply(x, half, out=t)
                np.add(t, st["s"], out=u)
                np.tanh(u, out=u)
                np.multiply(t, quarter, out=v)
                np.subtract(u, v, out=st["spare"])
                st["s"], st["spare"] = st["spare"], st["s"]
            else:
                tt = x * half
                st["s"] = np.tanh(tt + st["s"]) - tt * quarter

        loop = _loop(ws, w8)
    else:  # W3
        rng = np.random.default_rng(0)
        X = rng.standard_normal((4096, 1024), dtype=np.float32)
        y = rng.standard_normal(4096, dtype=np.float32)
        lr, m = np.float32(0.01), np.float32(4096)
        state = {"w": np.zeros(1024, np.float32), "spare": np.empty(1024, np.float32)}
        r, g = np.empty(4096, np.float32), np.empty(1024, np.float32)

        def sgd() -> None:
            if variant == "limit":
                np.matmul(X, state["w"], out=r)
                np.subtract(r, y, out=r)
                np.matmul(X.T, r, out=g)
                np.multiply(g, lr / m, out=g)
                np.subtract(state["w"], g, out=state["spare"])
                state["w"], state["spare"] = state["spare"], state["w"]
            else:
                w = state["w"]
                state["w"] = w - lr * (X.T @ (X @ w - y)) / m

        loop = _loop(ws, sgd)
    loop(warmup)
    chunk = max(1, repeat // CHUNKS)
    times: list[float] = []
    f0, s0 = _faults(), _system_s()
    done = 0
    while done < repeat:
        k = min(chunk, repeat - done)
        t0 = time.perf_counter()
        loop(k)
        times.append((time.perf_counter() - t0) / (k * per_call))
        done += k
    n_steps = repeat * per_call
    result: dict[str, Any] = {
        "step_s": statistics.median(times),
        "faults_per_step": (_faults() - f0) / n_steps,
        "system_s_per_step": (_system_s() - s0) / n_steps,
        "peak_rss_kib": peak_rss_kib(),
        "vm_peak_kib": _vm_peak_kib(),
        **extra,
    }
    if ws is not None:
        result["stats"] = ws.stats().as_dict()
        if "spills_after_cycle_3" in extra:
            result["spills_after_cycle_3"] = result["stats"]["spill_count"] - extra["spills_after_cycle_3"]
    return result


def _find_lib(name: str) -> str | None:
    for d in LIB_DIRS:
        hits = sorted(glob.glob(os.path.join(d, name)))
        if hits:
            return hits[0]
    return None


def _run_one(workload: str, variant: str, steps: int, preload: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    code = (
        "import json, rustws._bench as b; "
        f"print(json.dumps(b._worker({workload!r}, {'numpy' if preload else variant!r}, {steps})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload}/{variant} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratio_text(name: str, time: float, other: str, other_time: float) -> str:
    """A time ratio worded so that it cannot be misread: ``rustws / best peer (tcmalloc) = 1.20
    (rustws slower)``; below 1 the first is faster, above 1 slower."""
    r = time / other_time
    verdict = "the same" if round(r, 2) == 1.0 else f"{name} {'faster' if r < 1 else 'slower'}"
    return f"{name} / {other} = {r:.2f} ({verdict})"


def _fmt_time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def run_bench(
    quick: bool = False,
    workloads: str = ",".join(FAMILIES),
    repeats: int | None = None,
    out: str = "bench-results",
    quiet: bool = False,
) -> int:
    if repeats is not None and repeats < 1:
        print(f"bench: --repeats (runs per variant) must be at least 1, got {repeats}", file=sys.stderr)
        return 2
    wanted = [w.strip().upper() for w in workloads.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(FAMILIES))
    if unknown:
        print(f"bench: unknown workload(s) {', '.join(unknown)} (use {','.join(FAMILIES)})", file=sys.stderr)
        return 2
    names = [n for n in WORKLOADS if n.split("-")[0] in wanted]
    if "SKLEARN-fit" in names and not sklearn_available():
        print("SKLEARN-fit skipped: scikit-learn is not installed (pip install scikit-learn)")
        names.remove("SKLEARN-fit")
    if not names:
        print("bench: nothing to run", file=sys.stderr)
        return 2
    reps = repeats if repeats is not None else (3 if quick else 5)
    peers = {k: p for k, lib in PEERS.items() if (p := _find_lib(lib))}
    variants = ["numpy", "rustws", "limit", *peers]
    missing = sorted(set(PEERS) - set(peers))

    def variants_of(n: str) -> list[str]:
        return [v for v in variants if v != "limit" or n.split("-")[0] in WITH_LIMIT]

    plan = [(n, v) for n in names for _ in range(reps) for v in variants_of(n)]
    print(
        f"{len(plan)} runs: {len(names)} workloads x {len(variants)} variants x {reps} repeats,"
        " each in a fresh process"
    )
    if missing:
        print(
            f"not installed (skipped): {', '.join(missing)}"
            " (Debian: libjemalloc2 libmimalloc2.0 libtcmalloc-minimal4)"
        )
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {n: {v: [] for v in variants_of(n)} for n in names}
    with Progress(len(plan), "bench", quiet=quiet) as bar:
        for i, (n, v) in enumerate(plan):
            bar.update(i, f"{n} {v}")
            steps = WORKLOADS[n][3 if quick else 2]
            raw[n][v].append(_run_one(n, v, steps, peers.get(v)))
        bar.update(len(plan), "done")
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for n in names:
        summary[n] = {}
        for v in variants_of(n):
            runs = raw[n][v]
            summary[n][v] = {
                key: statistics.median(r.get(key, 0) for r in runs)
                for key in ("step_s", "faults_per_step", "system_s_per_step", "peak_rss_kib", "vm_peak_kib")
            }
            if v == "rustws":
                summary[n][v]["spills"] = statistics.median(r["stats"]["spill_count"] for r in runs)
                if "spills_after_cycle_3" in runs[0]:
                    summary[n][v]["spills_after_cycle_3"] = max(r["spills_after_cycle_3"] for r in runs)
    for n in names:
        s = summary[n]
        base = s["numpy"]
        limit = s.get("limit")
        print(f"\n{n}: {WORKLOADS[n][0]}")
        print(
            f"  {'variant':10}{'step':>12}{'t/limit':>10}{'t/numpy':>10}{'faults/step':>13}"
            f"{'sys/step':>12}{'peak RSS':>12}{'RSS/numpy':>10}{'VM peak':>11}"
        )
        for v in variants_of(n):
            r = s[v]
            vs_limit = f"{r['step_s'] / limit['step_s']:>9.2f}x" if limit else f"{'-':>10}"
            print(
                f"  {v:10}{_fmt_time(r['step_s']):>12}{vs_limit}{r['step_s'] / base['step_s']:>9.2f}x"
                f"{r['faults_per_step']:>13.1f}{_fmt_time(r['system_s_per_step']):>12}"
                f"{r['peak_rss_kib'] / 1024:>8.1f} MiB{r['peak_rss_kib'] / base['peak_rss_kib']:>9.2f}x"
                f"{r['vm_peak_kib'] / 1048576:>7.2f} GiB"
            )
        rw = s["rustws"]
        print(f"  rustws spills: {rw['spills']:.0f}", end="")
        if "spills_after_cycle_3" in rw:
            print(f" ({rw['spills_after_cycle_3']:.0f} after cycle 3)", end="")
        print()
        best_peer = min((v for v in s if v in PEERS), key=lambda v: s[v]["step_s"], default=None)
        if best_peer:
            print(
                "  "
                + ratio_text(
                    "rustws", s["rustws"]["step_s"], f"best peer ({best_peer})", s[best_peer]["step_s"]
                )
            )
        best = min((v for v in s if v in PEERS or v == "numpy"), key=lambda v: s[v]["step_s"])
        best_text = ratio_text("rustws", s["rustws"]["step_s"], f"best allocator ({best})", s[best]["step_s"])
        print("  " + best_text)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump({"summary": summary, "raw": raw, "repeats": reps, "quick": quick}, f, indent=1)
    _chart(summary, variants, os.path.join(out, "bench.png"))
    print(f"\nresults: {os.path.join(out, 'bench.json')}")
    return 0


def _chart(summary: dict[str, dict[str, dict[str, float]]], variants: list[str], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart: matplotlib is not installed (pip install 'rustws[plots]'); no PNG written")
        return
    names = [n for n in summary if "limit" in summary[n]]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4.5))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        vals = [summary[n][v]["step_s"] / summary[n]["limit"]["step_s"] for n in names]
        ax.bar([k + i * width for k in range(len(names))], vals, width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names)
    ax.set_ylabel("step time / limit (preallocated out=)")
    ax.set_title("rustws bench: median step time relative to no allocation at all")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")
