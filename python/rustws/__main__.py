"""Command line: ``python -m rustws demo | bench | info``."""

from __future__ import annotations

import argparse
import os
import sys


def _info() -> int:
    import numpy as np

    from . import __version__, _rustws

    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core.multiarray import get_handler_name

    info = _rustws.build_info()
    print(f"rustws {__version__} ({info['profile']} build, abi3 for CPython >= 3.11)")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    print(f"numpy memory handler now: {get_handler_name()}")
    from . import cuda

    reason = cuda.unavailable_reason(0)
    state = "available" if reason is None else f"unavailable: {reason}"
    print(f"cuda: {state}; the driver sees {cuda.device_count()} device(s)")
    print(f"cuda backend: {info['cuda_backend']}")
    print(f"block header: {info['header_bytes']} bytes, alignment 64 bytes")
    parked = info["parked_bytes"] / (1 << 20)
    print(f"regions waiting between workspaces entered in turn: {info['parked_regions']} ({parked:.1f} MiB)")
    for key in ("allocation", "learning", "spill", "reset", "mirroring", "location"):
        print(f"{key + ' policies:':22} {', '.join(info[key + '_policies'])}")
    mode = _rustws.env_debug_mode()
    print(f"RUSTWS_DEBUG_MODE: {mode or 'unset'}")
    print("libraries: " + ", ".join(f"{name} {version}" for name, version in _library_versions()))
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("RUSTWS_"))
    known = {
        "RUSTWS_DEBUG_MODE": "every workspace's debug mode",
        "RUSTWS_STRICT": "escapes raise LeakedArrayError when '1'",
        "RUSTWS_TRACE": "escape reports name allocation sites when '1'",
        "RUSTWS_OOM_SNAPSHOT": "records every workspace's history; a refusal dumps a memory snapshot here",
    }
    print("RUSTWS_* variables in force:" + ("" if env else " none"))
    for key, value in env:
        print(f"  {key}={value}  ({known.get(key, 'not read by this version')})")
    return 0


# What the integrations and users combine rustws with: (import name, distribution names).
_LIBRARIES = (
    ("numpy", ("numpy",)),
    ("torch", ("torch",)),
    ("cupy", ("cupy", "cupy-cuda12x", "cupy-cuda11x", "cupy-cuda13x")),
    ("jax", ("jax",)),
    ("dask", ("dask",)),
    ("distributed", ("distributed",)),
    ("tqdm", ("tqdm",)),
    ("matplotlib", ("matplotlib",)),
)


def _library_versions() -> list[tuple[str, str]]:
    """The installed version of each library rustws works with, without importing them (an
    import of PyTorch or JAX takes seconds and starts threads); "not installed" otherwise."""
    import importlib.metadata
    import importlib.util

    out = []
    for module, dists in _LIBRARIES:
        version = "not installed"
        if importlib.util.find_spec(module) is not None:
            version = "installed (version unknown)"
            for dist in dists:
                try:
                    version = importlib.metadata.version(dist)
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
        out.append((module, version))
    return out


def _replay(path: str, workspace: str | None) -> int:
    import pickle

    from .memory import recommend, recorded_workspaces

    try:
        with open(path, "rb") as f:
            snap = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        print(f"cannot read {path}: {e}", file=sys.stderr)
        return 2
    try:
        found = recorded_workspaces(snap)
        if workspace is not None:
            print(recommend(snap, workspace=int(workspace) if workspace.isdigit() else workspace).table())
            return 0
        if not found:
            raise ValueError("it holds no allocation of a workspace (was rustws.memory.record_history on?)")
        for wid, _ in found:
            print(recommend(snap, workspace=wid).table(), end="\n\n")
    except (ValueError, TypeError, KeyError) as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    from . import _bench

    parser = argparse.ArgumentParser(prog="python -m rustws", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a training loop with and without workspaces, side by side")
    demo.add_argument("--quick", action="store_true", help="a short run (for CI)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (batches) per epoch")
    demo.add_argument("--out", default="demo-results", help="folder for the memory timeline PNG")
    demo.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    bench = sub.add_parser(
        "bench", help="side-by-side allocator benchmarks (each variant in a fresh process)"
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    bench.add_argument(
        "--workloads",
        default=",".join(_bench.FAMILIES),
        help=f"comma-separated subset of {','.join(_bench.FAMILIES)}",
    )
    bench.add_argument("--repeats", type=int, default=None, help="runs per variant (median reported)")
    bench.add_argument("--out", default="bench-results", help="folder for the JSON results and the chart")
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sub.add_parser(
        "info",
        help="version, build, NumPy's memory handler, library versions, RUSTWS_* variables",
    )
    rep = sub.add_parser(
        "replay",
        help="replay a dumped memory snapshot's cycles and print the configuration recommended for them",
    )
    rep.add_argument("file", help="a pickle written by rustws.memory.dump_snapshot")
    rep.add_argument(
        "--workspace", default=None, help="the workspace to replay, by name or id (default: every one)"
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    if args.command == "replay":
        return _replay(args.file, args.workspace)
    if args.command == "demo":
        from ._demo import run_demo

        return run_demo(quick=args.quick, steps=args.steps, out=args.out, quiet=args.quiet)

    return _bench.run_bench(
        quick=args.quick, workloads=args.workloads, repeats=args.repeats, out=args.out, quiet=args.quiet
    )


if __name__ == "__main__":
    sys.exit(main())
