"""Device benchmarks, side by side in one process.

On a machine with a GPU (and PyTorch / CuPy where installed):

1. per call: ``ws.empty((n,), float32)`` of a device workspace in an open cycle, against
   ``torch.empty(device="cuda")`` and ``cupy.empty`` with their pools warm (median of interleaved
   rounds; goal: at most 0.5x their time);
2. a PyTorch training step of an MLP under ``rustws.torch.use_workspace`` (every thread, and the
   calling thread alone) against the caching allocator, plainly and in a ``torch.cuda.MemPool`` of its
   own entered each step as ours is: median step time (interleaved rounds),
   and, each variant in a fresh process, the peak reserved memory and the device memory 10 steps
   add (goal: at most 1.00x the time, no more memory), and whether all give the same losses;
3. a CuPy loop with ``cupy.cuda.set_allocator(rustws.cupy.allocator(ws))`` against CuPy's
   ``MemoryPool``: median time per iteration and the memory each holds afterwards;
4. the CuPy allocator per call (a 4 MiB block allocated and released) against
   ``MemoryPool.malloc``, and the parts of its cost.

With ``--standin`` (any machine) it times the host side of (1) alone: a device workspace over the
host stand-in against ``np.empty`` (goal: at most 1.0x its time). Arena allocations of a device
workspace make no driver call, so this is the per-call cost of the device path without a GPU.

    python benches/gpu.py [--rounds 15] [--out results.json]
    python benches/gpu.py --standin
"""

from __future__ import annotations

import argparse
import contextlib
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


TORCH_VARIANTS = (
    "caching allocator",
    "rustws.torch.use_workspace",
    "use_workspace(all_threads=False)",
    "caching allocator in use_mem_pool",
)


def torch_trainer(variant: str) -> tuple[Any, Any]:
    """An MLP training step on the GPU, and what each step runs under for ``variant``."""
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

    def step() -> Any:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    cfg = rustws.WorkspaceConfiguration(policy_mirroring="DISABLED")
    if variant == TORCH_VARIANTS[0]:
        return step, contextlib.nullcontext
    if variant == TORCH_VARIANTS[3]:
        # PyTorch's own pool block, routed as use_workspace(all_threads=False) routes: what
        # entering a pool for each step costs PyTorch itself, whoever serves the pool.
        pool = torch.cuda.MemPool()
        return step, lambda: torch.cuda.use_mem_pool(pool)
    ws = rustws.workspace(variant, cfg, device="cuda:0")
    all_threads = variant == TORCH_VARIANTS[1]
    return step, lambda: rustws.torch.use_workspace(ws, all_threads=all_threads)


def torch_memory(variant: str, steps: int = 10) -> dict[str, Any]:
    """In a fresh process: PyTorch's peak reserved memory over ``steps`` training steps under
    ``variant``, the device memory they added (a workspace's counts there), and the losses."""
    import torch

    torch.cuda.init()
    free, _ = torch.cuda.mem_get_info()
    step, under = torch_trainer(variant)
    losses = []
    for _ in range(steps):
        with under():
            loss = step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    return {
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "device_bytes_added": free - free_after,
        "losses": losses,
    }


def bench_torch_step(rounds: int) -> dict[str, Any]:
    import subprocess

    memory: dict[str, Any] = {}
    for variant in TORCH_VARIANTS:  # each in a process of its own
        done = subprocess.run(
            [sys.executable, __file__, "--torch-memory", variant], capture_output=True, text=True, check=True
        )
        memory[variant] = json.loads(done.stdout)
    base_memory = memory[TORCH_VARIANTS[0]]
    trainers = {v: torch_trainer(v) for v in TORCH_VARIANTS}
    import torch

    def steps(variant: str, k: int) -> float:
        step, under = trainers[variant]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            with under():
                step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / k

    for v in TORCH_VARIANTS:
        steps(v, 5)
    times: dict[str, list[float]] = {k: [] for k in TORCH_VARIANTS}
    for _ in range(rounds):
        for v in TORCH_VARIANTS:
            times[v].append(steps(v, 20))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med[TORCH_VARIANTS[0]]

    def enter_and_exit(variant: str) -> Any:
        under = trainers[variant][1]

        def block() -> None:
            with under():
                pass

        return block

    blocks = interleaved({v: enter_and_exit(v) for v in TORCH_VARIANTS}, rounds, 2_000)
    return {
        "step_ms": {k: v * 1e3 for k, v in med.items()},
        "empty_block_us": {k: v * 1e6 for k, v in blocks.items()},
        "time_ratio_over_caching": {k: v / base for k, v in med.items() if k != TORCH_VARIANTS[0]},
        "fresh_process_memory": {k: {n: m[n] for n in m if n != "losses"} for k, m in memory.items()},
        "peak_reserved_ratio_over_caching": {
            k: m["peak_reserved_bytes"] / base_memory["peak_reserved_bytes"]
            for k, m in memory.items()
            if k != TORCH_VARIANTS[0]
        },
        "same_losses_in_fresh_processes": all(m["losses"] == base_memory["losses"] for m in memory.values()),
        "same_losses_twin_models": same_losses(torch),
        "blocks_held_by_torch": rustws.torch.held_by_torch(),
    }


def same_losses(torch: Any) -> bool:
    """Whether 10 steps of twin models give bit-identical losses under both allocators."""
    import copy

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    twin = copy.deepcopy(model)
    x = torch.randn(128, 784, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")
    ws = rustws.workspace(
        "LOSSES", rustws.WorkspaceConfiguration(policy_mirroring="DISABLED"), device="cuda:0"
    )

    def losses(m: Any, under: Any) -> list[float]:
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        out = []
        for _ in range(10):
            with under():
                loss = torch.nn.functional.cross_entropy(m(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            out.append(loss.item())
        return out

    return losses(model, contextlib.nullcontext) == losses(twin, lambda: rustws.torch.use_workspace(ws))


def bench_cupy_loop(rounds: int) -> dict[str, Any]:
    import cupy

    ws = rustws.workspace("CUPY", rustws.WorkspaceConfiguration(policy_mirroring="DISABLED"), device="cuda:0")
    pool = cupy.cuda.MemoryPool()
    ours = rustws.cupy.allocator(ws)
    x = cupy.random.default_rng(0).standard_normal((1024, 1024), dtype=cupy.float32)

    def iteration() -> None:
        y = cupy.tanh(x @ x.T) * 0.5 + x
        z = (y - y.mean(axis=0)) / (y.std(axis=0) + 1e-6)
        z.sum()

    def run(allocator: Any, cycle: Any, k: int) -> float:
        previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(allocator)
        try:
            cupy.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            for _ in range(k):
                with cycle():
                    iteration()
            cupy.cuda.runtime.deviceSynchronize()
            return (time.perf_counter() - t0) / k
        finally:
            cupy.cuda.set_allocator(previous)

    # Each iteration is one cycle of the workspace (its cycles see only its own allocations).
    variants = {
        "cupy MemoryPool": (pool.malloc, contextlib.nullcontext),
        "rustws.cupy.allocator": (ours, lambda: ws),
    }
    for a, c in variants.values():
        run(a, c, 5)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, (a, c) in variants.items():
            samples[name].append(run(a, c, 20))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "iteration_us": {k: v * 1e6 for k, v in med.items()},
        "ratio_rustws_over_pool": med["rustws.cupy.allocator"] / med["cupy MemoryPool"],
        "held_bytes": {
            "cupy MemoryPool": pool.total_bytes(),
            "rustws.cupy.allocator": ws.stats().capacity_bytes,
        },
        "workspace_stats": str(ws.stats()),
    }


def bench_cupy_allocator_call(rounds: int) -> dict[str, Any]:
    """One 4 MiB allocation and its release per call: ``rustws.cupy.allocator(ws)`` in an open
    cycle against ``MemoryPool.malloc``, and the parts of ours (the workspace block, the stream
    lookup, CuPy's pointer objects)."""
    import cupy

    config = rustws.WorkspaceConfiguration(policy_mirroring="DISABLED")
    ws = rustws.workspace("CUPY-CALL", config, device="cuda:0")
    pool = cupy.cuda.MemoryPool()
    ours = rustws.cupy.allocator(ws)
    size = 4 << 20
    memory = cupy.cuda.memory
    variants = {
        "MemoryPool.malloc": lambda: pool.malloc(size),
        "rustws.cupy.allocator": lambda: ours(size),
        "part: workspace block": lambda: ws._buffer(size),
        "part: get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "part: UnownedMemory + MemoryPointer": lambda: memory.MemoryPointer(
            memory.UnownedMemory(1 << 40, size, None, 0), 0
        ),
    }
    with ws:
        med = interleaved(variants, rounds, 20_000)
    return {
        "per_call_ns": {k: v * 1e9 for k, v in med.items()},
        "ratio_rustws_over_pool": med["rustws.cupy.allocator"] / med["MemoryPool.malloc"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=1000, help="elements per ws.empty call")
    ap.add_argument("--standin", action="store_true", help="time the device path over the host stand-in")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--torch-memory", choices=TORCH_VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_memory:
        print(json.dumps(torch_memory(args.torch_memory)))
        return 0
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
        try:
            import cupy  # noqa: F401
        except ImportError:
            results["cupy_loop"] = "CuPy is not installed"
        else:
            results["cupy_loop"] = bench_cupy_loop(max(3, args.rounds // 3))
            results["cupy_allocator_call"] = bench_cupy_allocator_call(max(3, args.rounds // 2))
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
