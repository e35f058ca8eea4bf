"""Device benchmarks, side by side in one process.

On a machine with a GPU (and PyTorch / CuPy where installed):

1. per call: ``ws.empty((n,), float32)`` of a device workspace in an open cycle, against
   ``torch.empty(device="cuda")`` and ``cupy.empty`` with their pools warm (median of interleaved
   rounds; goal: at most 0.5x their time);
2. a PyTorch training step of an MLP under ``rustws.torch.use_workspace`` against the caching
   allocator: median step time and peak reserved memory (goal: within 1.05x, no more memory).

With ``--standin`` (any machine) it times the host side of (1) alone: a device workspace over the
host stand-in against ``np.empty`` (goal: at most 1.0x its time). Arena allocations of a device
workspace make no driver call, so this is the per-call cost of the device path without a GPU.

    python benches/gpu.py [--rounds 15] [--out results.json]
    python benches/gpu.py --standin
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import rustws


def per_call(fn: Any, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def interleaved(variants: dict[str, Any], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each variant, the variants alternating within each round."""
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up: pools, arenas, caches
        per_call(fn, calls)
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(per_call(fn, calls))
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_standin(rounds: int, n: int) -> dict[str, Any]:
    from rustws.cuda import _standin_workspace

    ws = _standin_workspace(
        "BENCH", rustws.WorkspaceConfiguration(initial_size="64MiB", policy_mirroring="DISABLED")
    )
    f32 = np.dtype(np.float32)
    with ws:
        t = interleaved(
            {
                "rustws device path (stand-in)": lambda: ws.empty((n,), f32),
                "np.empty": lambda: np.empty((n,), f32),
            },
            rounds,
            20_000,
        )
    base = t["rustws device path (stand-in)"]
    return {
        "per_call_ns": {k: v * 1e9 for k, v in t.items()},
        "ratio_rustws_over_np_empty": base / t["np.empty"],
    }


def bench_empty(rounds: int, n: int) -> dict[str, Any]:
    ws = rustws.workspace(
        "BENCH",
        rustws.WorkspaceConfiguration(initial_size="64MiB", policy_mirroring="DISABLED"),
        device="cuda:0",
    )
    f32 = np.dtype(np.float32)
    variants: dict[str, Any] = {"rustws ws.empty": lambda: ws.empty((n,), f32)}
    try:
        import torch

        variants["torch.empty"] = lambda: torch.empty((n,), dtype=torch.float32, device="cuda")
    except ImportError:
        pass
    try:
        import cupy

        variants["cupy.empty"] = lambda: cupy.empty((n,), cupy.float32)
    except ImportError:
        pass
    with ws:
        t = interleaved(variants, rounds, 5_000)
    out: dict[str, Any] = {"per_call_ns": {k: v * 1e9 for k, v in t.items()}}
    base = t["rustws ws.empty"]
    out["ratio_rustws_over"] = {k: base / v for k, v in t.items() if k != "rustws ws.empty"}
    return out


def bench_torch_step(rounds: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(256, 784, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    ws = rustws.workspace(
        "TORCH", rustws.WorkspaceConfiguration(policy_mirroring="DISABLED"), device="cuda:0"
    )

    def default_steps(k: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / k

    def rustws_steps(k: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with rustws.torch.use_workspace(ws):
            for _ in range(k):
                step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / k

    # Peak reserved memory of each, measured from a clean cache.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    default_steps(5)
    peak_default = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rustws_steps(5)
    peak_rustws = torch.cuda.max_memory_reserved()
    held = rustws.torch.held_by_torch()
    times: dict[str, list[float]] = {"caching allocator": [], "rustws.torch.use_workspace": []}
    for _ in range(rounds):
        times["caching allocator"].append(default_steps(20))
        times["rustws.torch.use_workspace"].append(rustws_steps(20))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "step_ms": {k: v * 1e3 for k, v in med.items()},
        "ratio_rustws_over_caching": med["rustws.torch.use_workspace"] / med["caching allocator"],
        "peak_reserved_bytes": {"caching allocator": peak_default, "rustws.torch.use_workspace": peak_rustws},
        "blocks_held_by_torch": held,
        "workspace_stats": ws.stats()._asdict() if hasattr(ws.stats(), "_asdict") else str(ws.stats()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=1000, help="elements per ws.empty call")
    ap.add_argument("--standin", action="store_true", help="time the device path over the host stand-in")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results: dict[str, Any] = {"rustws": rustws.__version__, "numpy": np.__version__}
    if args.standin:
        results["empty"] = bench_standin(args.rounds, args.n)
    else:
        reason = rustws.cuda.unavailable_reason(0)
        if reason is not None:
            print(f"no usable GPU ({reason}); run with --standin for the host side", file=sys.stderr)
            return 2
        results["empty"] = bench_empty(args.rounds, args.n)
        try:
            import torch  # noqa: F401
        except ImportError:
            results["torch_step"] = "PyTorch is not installed"
        else:
            results["torch_step"] = bench_torch_step(max(3, args.rounds // 3))
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
