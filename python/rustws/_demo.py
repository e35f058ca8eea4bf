"""The demo: a NumPy MLP (two hidden layers, softmax, SGD with momentum) trained twice from the same
seed: once plainly, once with workspaces (a ``LayerWorkspaceMgr`` placing activations, gradients
and working memory, capture of every temporary, and ``AsyncPrefetch`` feeding the batches). Each
training runs in a fresh process so that its page faults and peak RSS are its own; the losses must
be identical.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._bench import peak_rss_kib as _peak_rss_kib
from ._progress import progress

HIDDEN = 512
TYPES = ("ACTIVATIONS", "ACTIVATION_GRAD", "FF_WORKING_MEM", "BP_WORKING_MEM", "UPDATER_WORKING_MEM")


def _dataset(seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """scikit-learn's bundled digits when installed, else generated clusters (no download)."""
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-not-found]

        d = load_digits()
        x = (d.data / 16.0).astype(np.float32)
        x = np.tile(x, (4, 1)) + np.random.default_rng(seed).normal(0, 0.05, (4 * len(x), x.shape[1]))
        return x.astype(np.float32), np.tile(d.target, 4), "scikit-learn digits (x4, jittered)"
    except ImportError:
        rng = np.random.default_rng(seed)
        centers = rng.normal(0, 1.0, (10, 64)).astype(np.float32)
        y = rng.integers(0, 10, 8192)
        x = centers[y] + rng.normal(0, 3.0, (len(y), 64)).astype(np.float32)
        return x, y, "generated clusters (64 features, 10 classes)"


class _Plain:
    """Memory placement for the plain run: everything in ordinary memory, no scopes."""

    def scope(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def create(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, np.float32)


class _Managed:
    """Memory placement through a LayerWorkspaceMgr: each ArrayType in its own workspace, but the
    forward and backward working memory, whose cycles never overlap, share one (as DL4J's
    ``WS_LAYER_WORKING_MEM`` does), so that their arenas are not resident twice."""

    SHARED = {"FF_WORKING_MEM": "LAYER_WORKING_MEM", "BP_WORKING_MEM": "LAYER_WORKING_MEM"}

    def __init__(self) -> None:
        from . import ArrayType, LayerWorkspaceMgr, SpillPolicy, WorkspaceConfiguration

        cfg = WorkspaceConfiguration(policy_spill=SpillPolicy.REALLOCATE)
        b = LayerWorkspaceMgr.builder()
        for t in TYPES:
            b = b.with_(ArrayType[t], self.SHARED.get(t, t), cfg)
        self.mgr = b.default_no_workspace().build()
        self.types = ArrayType

    def scope(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return self.mgr.notify_scope_entered(self.types[name])

    def create(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self.mgr.create(self.types[name], shape, np.float32)


def _step(params: list[np.ndarray], vel: list[np.ndarray], x: np.ndarray, y: np.ndarray, mem: Any) -> float:
    w1, b1, w2, b2, w3, b3 = params
    n = len(y)
    # As DL4J's layers do: a layer's output is made in its ArrayType's workspace and written there
    # (`out=`); only the temporaries of computing it come from working memory.
    with mem.scope("ACTIVATIONS"), mem.scope("ACTIVATION_GRAD"):
        with mem.scope("FF_WORKING_MEM"):
            h1 = np.maximum(x @ w1 + b1, 0, out=mem.create("ACTIVATIONS", (n, w1.shape[1])))
            h2 = np.maximum(h1 @ w2 + b2, 0, out=mem.create("ACTIVATIONS", (n, w2.shape[1])))
            logits = h2 @ w3 + b3
            logits -= logits.max(axis=1, keepdims=True)
            d = np.exp(logits, out=mem.create("ACTIVATION_GRAD", logits.shape))
            d /= d.sum(axis=1, keepdims=True)
            loss = float(-np.log(d[np.arange(n), y] + 1e-12).mean())
        with mem.scope("BP_WORKING_MEM"):
            d[np.arange(n), y] -= 1
            d /= n
            gw3 = np.matmul(h2.T, d, out=mem.create("ACTIVATION_GRAD", w3.shape))
            gb3 = np.sum(d, axis=0, out=mem.create("ACTIVATION_GRAD", b3.shape))
            d2 = np.multiply(d @ w3.T, h2 > 0, out=mem.create("ACTIVATION_GRAD", h2.shape))
            gw2 = np.matmul(h1.T, d2, out=mem.create("ACTIVATION_GRAD", w2.shape))
            gb2 = np.sum(d2, axis=0, out=mem.create("ACTIVATION_GRAD", b2.shape))
            d1 = (d2 @ w2.T) * (h1 > 0)
            gw1 = np.matmul(x.T, d1, out=mem.create("ACTIVATION_GRAD", w1.shape))
            gb1 = np.sum(d1, axis=0, out=mem.create("ACTIVATION_GRAD", b1.shape))
            grads = [gw1, gb1, gw2, gb2, gw3, gb3]
        with mem.scope("UPDATER_WORKING_MEM"):
            for param, v, g in zip(params, vel, grads, strict=True):
                v *= 0.9
                v -= 0.05 * g
                param += v
        # Nothing of this step outlives its cycles: the workspaces rewind without pinning.
        del h1, h2, logits, d, d1, d2, grads, g, gw1, gb1, gw2, gb2, gw3, gb3
    return loss


def _batches(
    x: np.ndarray, y: np.ndarray, batch: int, order: np.ndarray
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for i in range(0, len(order) - batch + 1, batch):
        idx = order[i : i + batch]
        yield x[idx], y[idx]


def _train(variant: str, epochs: int, batches_per_epoch: int, seed: int) -> dict[str, Any]:
    import rustws

    x, y, source = _dataset(seed)
    batch = max(32, len(x) // batches_per_epoch)
    rng = np.random.default_rng(seed)
    dims = [x.shape[1], HIDDEN, HIDDEN, 10]
    params: list[np.ndarray] = []
    for i, o in itertools.pairwise(dims):
        params += [
            (rng.standard_normal((i, o)) * np.sqrt(2.0 / i)).astype(np.float32),
            np.zeros(o, np.float32),
        ]
    vel = [np.zeros_like(p) for p in params]
    mem: Any = _Managed() if variant == "rustws" else _Plain()
    losses: list[float] = []
    epoch_times: list[float] = []
    timeline: list[dict[str, int]] = []
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for epoch in range(epochs):
        order = np.random.default_rng(seed + epoch).permutation(len(x))
        feed = _batches(x, y, batch, order)
        t0 = time.perf_counter()
        with (
            rustws.AsyncPrefetch(feed, buffer_size=4)
            if variant == "rustws"
            else contextlib.nullcontext(feed) as it
        ):
            for xb, yb in it:
                losses.append(_step(params, vel, xb, yb, mem))
                if variant == "rustws":
                    kinds = {"peak in use": 0, "arena": 0, "pinned": 0}
                    # Each workspace once (working memories share one).
                    spaces = {id(w): w for w in (mem.mgr.workspace_for(mem.types[t]) for t in TYPES)}
                    for ws in spaces.values():
                        s = ws.stats()
                        kinds["peak in use"] += s.peak_cycle_bytes
                        kinds["arena"] += s.capacity_bytes
                        kinds["pinned"] += s.pinned_bytes
                    timeline.append(kinds)
        epoch_times.append(time.perf_counter() - t0)
        print(f"PROGRESS {epoch + 1}/{epochs}", file=sys.stderr, flush=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out: dict[str, Any] = {
        "variant": variant,
        "source": source,
        "batch": batch,
        "losses": losses,
        "epoch_s": epoch_times,
        "faults": usage.ru_minflt - f0,
        "steps": len(losses),
        "peak_rss_kib": _peak_rss_kib(),
        "timeline": timeline,
    }
    if variant == "rustws":
        out["per_type"] = {
            t: {
                "peak_bytes": mem.mgr.peak_stats()[mem.types[t]],
                **mem.mgr.workspace_for(mem.types[t]).stats().as_dict(),
            }
            for t in TYPES
        }
    return out


def _run_variant(variant: str, epochs: int, batches: int) -> dict[str, Any]:
    code = f"import json, rustws._demo as d; print(json.dumps(d._train({variant!r}, {epochs}, {batches}, 7)))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stderr is not None and proc.stdout is not None
    errors = []
    for line in proc.stderr:
        if line.startswith("PROGRESS "):
            done, total = map(int, line.split()[1].split("/"))
            progress(f"{variant}: epoch {done}/{total}", done, total, sys.stdout)
        else:
            errors.append(line)
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{variant} training failed:\n{''.join(errors)}")
    return json.loads(out.strip().splitlines()[-1])


def _timeline_png(timeline: list[dict[str, int]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'rustws[plots]'): no memory timeline written"
    steps = list(range(1, len(timeline) + 1))
    mib = {k: [t[k] / 2**20 for t in timeline] for k in timeline[0]} if timeline else {}
    fig, ax = plt.subplots(figsize=(8, 4))
    if timeline:
        ax.fill_between(steps, 0, mib["arena"], step="mid", alpha=0.3, label="arena capacity")
        ax.step(steps, mib["peak in use"], where="mid", label="peak in use during the cycle")
        ax.step(steps, mib["pinned"], where="mid", label="pinned after the cycle")
    ax.set_xlabel("cycle (training step); the first is served outside the arena while learning")
    ax.set_ylabel("MiB, all ArrayType workspaces")
    ax.set_title("rustws demo: workspace memory per cycle")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"memory timeline: {path}"


def run_demo(quick: bool = False, steps: int | None = None, out: str = "demo-results") -> int:
    from ._workspace import _fmt_bytes

    epochs = 2 if quick else 10
    batches = steps if steps is not None else 6
    if batches < 2:
        print("demo: --steps (batches per epoch) must be at least 2", file=sys.stderr)
        return 2
    results = {v: _run_variant(v, epochs, batches) for v in ("numpy", "rustws")}
    base, ws = results["numpy"], results["rustws"]
    print(
        f"MLP in-{HIDDEN}-{HIDDEN}-10, batch {base['batch']}, on {base['source']}: "
        f"{epochs} epochs of {batches} steps"
    )
    same = base["losses"] == ws["losses"]
    print(
        f"\n{'':8}{'epoch (median)':>16}{'faults/step':>13}{'peak RSS':>12}"
        f"{'first loss':>12}{'last loss':>11}"
    )
    for v, r in results.items():
        print(
            f"{v:8}{np.median(r['epoch_s']) * 1e3:>13.1f} ms{r['faults'] / r['steps']:>13.1f}"
            f"{_fmt_bytes(r['peak_rss_kib'] * 1024):>12}{r['losses'][0]:>12.4f}{r['losses'][-1]:>11.4f}"
        )
    speed = np.median(base["epoch_s"]) / np.median(ws["epoch_s"])
    print(f"speed-up {speed:.2f}x; losses identical in all {len(base['losses'])} steps: {same}")
    print(f"\n{'ArrayType':22}{'peak live':>11}{'capacity':>11}{'cycles':>8}{'spills':>8}")
    for t, s in ws["per_type"].items():
        print(
            f"{t:22}{_fmt_bytes(s['peak_bytes']):>11}{_fmt_bytes(s['capacity_bytes']):>11}"
            f"{s['cycles']:>8}{s['spill_count']:>8}"
        )
    grad = (
        ws["per_type"]["ACTIVATION_GRAD"]["peak_bytes"] + ws["per_type"]["UPDATER_WORKING_MEM"]["peak_bytes"]
    )
    print(f"gradient memory (ACTIVATION_GRAD + UPDATER_WORKING_MEM): {_fmt_bytes(grad)}")
    os.makedirs(out, exist_ok=True)
    print(_timeline_png(ws["timeline"], os.path.join(out, "memory-timeline.png")))
    if not same:
        print("ERROR: the two trainings diverged", file=sys.stderr)
    return 0 if same else 1
