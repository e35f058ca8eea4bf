"""The demo: a NumPy MLP (two hidden layers, softmax, SGD with momentum) trained twice from the same
seed, once plainly and once with every step's temporaries captured by a workspace. Each training
runs in a fresh process so that page faults and peak RSS are its own; the losses must be identical.
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ._progress import progress

FEATURES, HIDDEN, CLASSES, BATCH = 256, 1024, 10, 512


def _dataset(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters, one per class: learnable, generated, no download."""
    centers = rng.normal(0, 1.0, (CLASSES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, n)
    x = centers[y] + rng.normal(0, 2.0, (n, FEATURES)).astype(np.float32)
    return x, y


def _init(rng: np.random.Generator) -> list[np.ndarray]:
    def layer(i: int, o: int) -> list[np.ndarray]:
        return [(rng.standard_normal((i, o)) * np.sqrt(2.0 / i)).astype(np.float32), np.zeros(o, np.float32)]

    return layer(FEATURES, HIDDEN) + layer(HIDDEN, HIDDEN) + layer(HIDDEN, CLASSES)


def _step(params: list[np.ndarray], vel: list[np.ndarray], x: np.ndarray, y: np.ndarray, lr: float) -> float:
    w1, b1, w2, b2, w3, b3 = params
    h1 = np.maximum(x @ w1 + b1, 0)
    h2 = np.maximum(h1 @ w2 + b2, 0)
    logits = h2 @ w3 + b3
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d = p
    d[np.arange(n), y] -= 1
    d /= n
    g3, gb3 = h2.T @ d, d.sum(0)
    d2 = (d @ w3.T) * (h2 > 0)
    g2, gb2 = h1.T @ d2, d2.sum(0)
    d1 = (d2 @ w2.T) * (h1 > 0)
    g1, gb1 = x.T @ d1, d1.sum(0)
    for param, v, g in zip(params, vel, (g1, gb1, g2, gb2, g3, gb3), strict=True):
        v *= 0.9
        v -= lr * g
        param += v
    return loss


def _train(variant: str, steps: int, seed: int) -> dict[str, Any]:
    import rustws

    rng = np.random.default_rng(seed)
    x, y = _dataset(rng, BATCH * 8)
    params = _init(rng)
    vel = [np.zeros_like(p) for p in params]
    ws = rustws.workspace("TRAIN") if variant == "rustws" else None
    losses, times = [], []
    faults = []
    usage = resource.getrusage(resource.RUSAGE_SELF)
    for step in range(steps):
        b = step % 8
        xb, yb = x[b * BATCH : (b + 1) * BATCH], y[b * BATCH : (b + 1) * BATCH]
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with ws if ws is not None else contextlib.nullcontext():
            losses.append(_step(params, vel, xb, yb, 0.05))
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    out: dict[str, Any] = {
        "variant": variant,
        "losses": losses,
        "step_median_s": float(np.median(times[2:])),
        "faults_per_step": float(np.median(faults[2:])),
        "faults_total": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - usage.ru_minflt,
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if ws is not None:
        out["stats"] = ws.stats().as_dict()
    return out


def run_demo(quick: bool = False, steps: int | None = None) -> int:
    from ._workspace import _fmt_bytes

    n = steps if steps is not None else (12 if quick else 60)
    if n < 3:
        print("demo: --steps must be at least 3", file=sys.stderr)
        return 2
    print(
        f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {BATCH}, {n} steps of SGD with momentum, float32"
    )
    results = {}
    variants = ["numpy", "rustws"]
    for i, variant in enumerate(variants):
        progress(f"training: {variant}", i, len(variants), sys.stdout)
        code = f"import json, rustws._demo as d; print(json.dumps(d._train({variant!r}, {n}, 7)))"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"\n{variant} run failed:\n{proc.stderr}", file=sys.stderr)
            return 1
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        progress(f"training: {variant}", i + 1, len(variants), sys.stdout)
    base, ws = results["numpy"], results["rustws"]
    same = base["losses"] == ws["losses"]
    print(f"{'':10}{'step (median)':>15}{'faults/step':>13}{'peak RSS':>12}{'final loss':>12}")
    for v in variants:
        r = results[v]
        print(
            f"{v:10}{r['step_median_s'] * 1e3:>12.2f} ms{r['faults_per_step']:>13.0f}"
            f"{_fmt_bytes(r['peak_rss_kib'] * 1024):>12}{r['losses'][-1]:>12.4f}"
        )
    print(f"speed-up: {base['step_median_s'] / ws['step_median_s']:.2f}x; losses identical: {same}")
    s = ws["stats"]
    print(
        "workspace TRAIN: "
        + ", ".join(
            f"{k}={_fmt_bytes(v) if k.endswith('_bytes') else v}"
            for k, v in s.items()
            if v or k == "spill_count"
        )
    )
    return 0 if same else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo(quick="--quick" in sys.argv))
