"""The demo: a NumPy MLP (two hidden layers, softmax, SGD with momentum) trained twice from the same
seed: once plainly, once with workspaces placed by a ``LayerWorkspaceMgr`` as DL4J's layers place
them (activations and their gradients each in a workspace, the working memories of the forward pass,
the backward pass and the updater sharing one) with every temporary captured. Each training runs in
a fresh process so that its page faults and peak RSS are its own; the losses must be identical.

It reports time, page faults and resident set per step for both, what the workspaces still cost,
each workspace's peak in use against its arena, and draws the story (``demo.png``) when matplotlib
is installed. Batches are fetched in the training thread in both runs: ``AsyncPrefetch`` would keep
``buffer_size + 2`` batches and a thread of its own resident, which this comparison of resident sets
leaves out.
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
from ._progress import Progress

HIDDEN = 512
ROUNDS = 3  # fresh processes per variant, alternating (the quick run makes one)
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
    """Memory placement through a LayerWorkspaceMgr, as DL4J's layers use it: activations and their
    gradients each in a workspace of their own (they live across the step), and the working memories
    of the forward pass, the backward pass and the updater, whose cycles never overlap, in one shared
    workspace (DL4J's ``WS_LAYER_WORKING_MEM``), so that no arena is resident twice. Every arena is
    sized exactly to the peak its first cycle showed (``STRICT``): overallocation would be resident
    memory NumPy does not hold."""

    SHARED = {
        "FF_WORKING_MEM": "LAYER_WORKING_MEM",
        "BP_WORKING_MEM": "LAYER_WORKING_MEM",
        "UPDATER_WORKING_MEM": "LAYER_WORKING_MEM",
    }

    def __init__(self) -> None:
        from . import ArrayType, LayerWorkspaceMgr, WorkspaceConfiguration

        cfg = WorkspaceConfiguration(policy_allocation="STRICT", policy_spill="REALLOCATE")
        b = LayerWorkspaceMgr.builder()
        for t in TYPES:
            b = b.with_(ArrayType[t], self.SHARED.get(t, t), cfg)
        self.mgr = b.default_no_workspace().build()
        self.types = ArrayType
        # Each workspace's largest peak in use during the current step (a shared workspace has
        # several cycles per step), for the timeline.
        self.step_peak: dict[str, int] = {}

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[Any]:
        with self.mgr.notify_scope_entered(self.types[name]) as ws:
            yield ws
        if ws is not None and not ws.is_open:
            peak = ws.stats().peak_cycle_bytes
            self.step_peak[ws.name] = max(self.step_peak.get(ws.name, 0), peak)

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


def _rss_kib() -> int:
    """This process's resident set now, in KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _train(variant: str, epochs: int, batches_per_epoch: int, seed: int) -> dict[str, Any]:
    import rustws  # noqa: F401  (both runs carry the same library)

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
    managed = variant == "rustws"
    mem: Any = _Managed() if managed else _Plain()
    losses: list[float] = []
    step_s: list[float] = []
    step_faults: list[int] = []
    step_rss: list[int] = []
    step_hwm: list[int] = []
    arena: list[int] = []
    live: list[int] = []
    peak_in_use: dict[str, int] = {}
    spaces: dict[int, Any] = {}
    for epoch in range(epochs):
        order = np.random.default_rng(seed + epoch).permutation(len(x))
        feed = _batches(x, y, batch, order)
        with contextlib.nullcontext(feed) as it:
            # A step is timed from the end of the previous one: fetching the batch is part of it.
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for xb, yb in it:
                losses.append(_step(params, vel, xb, yb, mem))
                t1 = time.perf_counter()
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                step_s.append(t1 - t0)
                step_faults.append(f1 - f0)
                step_rss.append(_rss_kib())
                step_hwm.append(_peak_rss_kib())
                if managed:
                    if not spaces:  # each workspace once (the working memories share one)
                        for t in TYPES:
                            ws = mem.mgr.workspace_for(mem.types[t])
                            spaces.setdefault(id(ws), ws)
                    arena.append(sum(ws.stats().capacity_bytes for ws in spaces.values()))
                    live.append(sum(mem.step_peak.values()))
                    for name, peak in mem.step_peak.items():
                        peak_in_use[name] = max(peak_in_use.get(name, 0), peak)
                    mem.step_peak.clear()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
        print(f"PROGRESS {epoch + 1}/{epochs}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "variant": variant,
        "source": source,
        "batch": batch,
        "losses": losses,
        "step_s": step_s,
        "step_faults": step_faults,
        "step_rss_kib": step_rss,
        "step_peak_rss_kib": step_hwm,
        "peak_rss_kib": _peak_rss_kib(),
        "arena": arena,
        "live": live,
    }
    if managed:
        per_workspace = {}
        for ws in spaces.values():
            st = ws.stats()
            types = [t for t in TYPES if mem.mgr.workspace_name(mem.types[t]) == ws.name]
            per_workspace[ws.name] = {
                "types": types,
                "peak_in_use": peak_in_use[ws.name],
                "capacity": st.capacity_bytes,
                "cycles": st.cycles,
                "spills": st.spill_count,
                "pinned": st.pinned_bytes,
                "made_by_mgr": sum(mem.mgr.peak_stats()[mem.types[t]] for t in types),
            }
        out["per_workspace"] = per_workspace
    return out


def _run_variant(variant: str, epochs: int, batches: int, quiet: bool) -> dict[str, Any]:
    code = f"import json, rustws._demo as d; print(json.dumps(d._train({variant!r}, {epochs}, {batches}, 7)))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stderr is not None and proc.stdout is not None
    errors = []
    with Progress(epochs, f"demo {variant}", quiet=quiet, lines=epochs) as bar:
        for line in proc.stderr:
            if line.startswith("PROGRESS "):
                done, total = map(int, line.split()[1].split("/"))
                bar.update(done, f"epoch {done}/{total}")
            else:
                errors.append(line)
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{variant} training failed:\n{''.join(errors)}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _story_png(base: dict[str, Any], ws: dict[str, Any], path: str) -> str:
    """Three panels: time per step of both runs, resident set of both runs, and the arenas'
    capacity against the bytes in use at each cycle's peak."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'rustws[plots]'): no PNG written"
    steps = list(range(1, len(base["step_s"]) + 1))
    fig, (ax_t, ax_r, ax_m) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for r, color in ((base, "tab:gray"), (ws, "tab:blue")):
        label = "NumPy" if r is base else "rustws"
        ax_t.plot(steps, [t * 1e3 for t in r["step_s"]], color=color, label=label, linewidth=1.2)
        ax_r.plot(steps, [k / 1024 for k in r["step_rss_kib"]], color=color, label=f"{label}, after the step")
        ax_r.plot(
            steps,
            [k / 1024 for k in r["step_peak_rss_kib"]],
            color=color,
            linestyle="--",
            label=f"{label}, peak so far (within steps)",
        )
    ax_t.set_ylabel("ms per step")
    ax_t.set_title("time per training step (first steps: rustws learns its arenas)")
    ax_t.legend(fontsize=8)
    ax_r.set_ylabel("MiB resident")
    ax_r.set_title(
        f"resident set: NumPy rises to {base['peak_rss_kib'] / 1024:.1f} MiB within each step and "
        f"falls back; rustws holds {ws['peak_rss_kib'] / 1024:.1f} MiB"
    )
    ax_r.legend(fontsize=8)
    mib = 2**20
    ax_m.fill_between(steps, 0, [a / mib for a in ws["arena"]], step="mid", alpha=0.3, label="arena capacity")
    ax_m.step(steps, [v / mib for v in ws["live"]], where="mid", label="bytes in use at the cycle's peak")
    ax_m.set_ylabel("MiB, all workspaces")
    ax_m.set_xlabel("training step (one cycle of each workspace)")
    ax_m.set_title("rustws: arena capacity vs bytes in use (STRICT: arenas sized to the learned peak)")
    ax_m.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"the story in one picture: {path}"


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's rounds as one: per step, the median time and faults over the rounds; the
    median peak; the last round's timelines. Every round must have computed the same losses."""
    out = dict(runs[-1])
    for r in runs:
        if r["losses"] != out["losses"]:
            out["losses"] = []  # reported as diverged
    out["step_s"] = [float(np.median(v)) for v in zip(*(r["step_s"] for r in runs), strict=True)]
    out["step_faults"] = [float(np.median(v)) for v in zip(*(r["step_faults"] for r in runs), strict=True)]
    out["peak_rss_kib"] = float(np.median([r["peak_rss_kib"] for r in runs]))
    out["rounds"] = len(runs)
    return out


def _ratio(name: str, a: float, other: str, b: float, smaller: str, larger: str) -> str:
    r = a / b
    verdict = "the same" if round(r, 2) == 1.0 else f"{name} {smaller if r < 1 else larger}"
    return f"{name} / {other} = {r:.2f} ({verdict})"


def run_demo(
    quick: bool = False, steps: int | None = None, out: str = "demo-results", quiet: bool = False
) -> int:
    from ._workspace import _fmt_bytes

    epochs = 2 if quick else 10
    batches = steps if steps is not None else 6
    if batches < 2:
        print("demo: --steps (batches per epoch) must be at least 2", file=sys.stderr)
        return 2
    rounds = 1 if quick else ROUNDS
    runs: dict[str, list[dict[str, Any]]] = {"numpy": [], "rustws": []}
    for _ in range(rounds):  # alternating, so that both see the same machine load
        for v, done in runs.items():
            done.append(_run_variant(v, epochs, batches, quiet))
    results = {v: _merge(r) for v, r in runs.items()}
    base, ws = results["numpy"], results["rustws"]
    print(
        f"MLP in-{HIDDEN}-{HIDDEN}-10, batch {base['batch']}, on {base['source']}: "
        f"{epochs} epochs of {batches} steps; {rounds} fresh process(es) per variant, alternating, "
        "medians per step"
    )
    same = base["losses"] == ws["losses"]
    warm = slice(min(3, len(base["step_s"]) - 1), None)  # after the learning steps
    print(
        f"\n{'':8}{'step (median)':>14}{'first step':>12}{'faults/step':>13}{'peak RSS':>11}{'last loss':>11}"
    )
    for v, r in results.items():
        print(
            f"{v:8}{np.median(r['step_s'][warm]) * 1e3:>11.2f} ms{r['step_s'][0] * 1e3:>9.1f} ms"
            f"{np.median(r['step_faults'][warm]):>13.0f}{_fmt_bytes(r['peak_rss_kib'] * 1024):>11}"
            f"{r['losses'][-1]:>11.4f}"
        )
    t_ws, t_np = np.median(ws["step_s"][warm]), np.median(base["step_s"][warm])
    print(_ratio("rustws", t_ws, "NumPy time per step", t_np, "faster", "slower"))
    print(_ratio("rustws", ws["peak_rss_kib"], "NumPy peak RSS", base["peak_rss_kib"], "smaller", "larger"))
    print(f"losses identical in all {len(base['losses'])} steps: {same}")
    costs = []
    if ws["step_s"][0] > base["step_s"][0] * 1.05:
        costs.append(
            f"the first step, while the workspaces learn, takes {ws['step_s'][0] * 1e3:.1f} ms "
            f"against {base['step_s'][0] * 1e3:.1f} ms"
        )
    if t_ws > t_np * 1.02:
        costs.append(f"a learned step takes {t_ws / t_np:.2f}x NumPy's time")
    if ws["peak_rss_kib"] > base["peak_rss_kib"]:
        costs.append(
            f"the peak resident set is {(ws['peak_rss_kib'] - base['peak_rss_kib']) / 1024:.1f} MiB "
            "above NumPy's"
        )
    arena_now = ws["arena"][-1] if ws["arena"] else 0
    costs.append(
        f"the arenas stay resident between steps ({_fmt_bytes(arena_now)}), as NumPy's heap does not"
    )
    print("what it costs: " + "; ".join(costs))
    print(f"\n{'workspace (ArrayTypes)':42}{'peak in use':>12}{'arena':>10}{'headroom':>10}{'spills':>8}")
    suggestions = []
    for name, p in ws["per_workspace"].items():
        head = p["capacity"] - p["peak_in_use"]
        label = f"{name} ({', '.join(p['types'])})" if p["types"] != [name] else name
        print(
            f"{label[:42]:42}{_fmt_bytes(p['peak_in_use']):>12}{_fmt_bytes(p['capacity']):>10}"
            f"{_fmt_bytes(max(head, 0)):>10}{p['spills']:>8}"
        )
        suggestions.append(f"{name}: initial_size={_round_up(p['peak_in_use'])}")
    print(
        "to skip the learning steps, size each workspace from its peak and stop learning "
        "(WorkspaceConfiguration(initial_size=..., policy_learning='NONE', policy_allocation='STRICT')): "
        + ", ".join(suggestions)
    )
    os.makedirs(out, exist_ok=True)
    print(_story_png(base, ws, os.path.join(out, "demo.png")))
    if not same:
        print("ERROR: the two trainings diverged", file=sys.stderr)
    return 0 if same else 1


def _round_up(n: int) -> str:
    """``n`` bytes rounded up to a size string a configuration takes (KiB or MiB)."""
    if n <= 1 << 20:
        return f'"{max(1, -(-n // 1024))}KiB"'
    return f'"{-(-n // (1 << 20))}MiB"'
