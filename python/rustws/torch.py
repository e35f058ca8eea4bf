"""PyTorch integration: ``with rustws.torch.use_workspace(ws):`` routes PyTorch's CUDA
allocations made in the block to the device workspace ``ws``.

The extension module exports ``rustws_torch_malloc`` / ``rustws_torch_free`` with the signatures
``torch.cuda.memory.CUDAPluggableAllocator`` loads. They serve PyTorch's caching allocator
through a ``torch.cuda.MemPool`` of the workspace, made current for the block, and PyTorch keeps
caching the segments it gets: a training step runs as it does under the default allocator, with
its memory from the workspace (its arena when it has one, its limits, its statistics).

The autograd engine runs a backward pass on a device thread of its own, so by default the block
routes every thread's allocations on the workspace's device, that thread's included (as a CUDA
graph capture does); ``all_threads=False`` routes the calling thread's alone, as
``torch.cuda.use_mem_pool`` does, and leaves the backward pass to the default allocator.

Segments return to the workspace when PyTorch releases them, whenever that is; a destroyed
workspace keeps them until then.

PyTorch is not a dependency of rustws: it is imported on first use, with a clear error when it is
missing or too old.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from . import _rustws
from .cuda import _gpu_ordinal

__all__ = ["pluggable_allocator", "use_workspace"]

_local = threading.local()
_allocator: Any = None


def _routes() -> list[tuple[Any, int]]:
    routes = getattr(_local, "routes", None)
    if routes is None:
        routes = _local.routes = []
    return routes


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError("rustws.torch needs PyTorch, which is not installed (pip install torch)") from e
    return torch


def _route(ws: Any, ordinal: int) -> None:
    """Pushes ``ws`` as the target of this thread's calls of the exported allocation functions."""
    routes = _routes()
    routes.append((ws, ordinal))
    _rustws.torch_route(ws, ordinal)


def _unroute(ws: Any) -> None:
    """Pops this thread's innermost route of ``ws``; the previous target (if any) takes over."""
    routes = _routes()
    for i in range(len(routes) - 1, -1, -1):
        if routes[i][0] is ws:
            del routes[i]
            break
    if routes:
        _rustws.torch_route(*routes[-1])
    else:
        _rustws.torch_route(None)


def pluggable_allocator() -> Any:
    """The process's ``CUDAPluggableAllocator`` over this module's exported functions."""
    global _allocator
    if _allocator is None:
        torch = _torch()
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _rustws.__file__, "rustws_torch_malloc", "rustws_torch_free"
        )
    return _allocator


_POOL_BINDINGS = ("_cuda_beginAllocateToPool", "_cuda_endAllocateToPool", "_cuda_releasePool")


def _pool_api(torch: Any) -> tuple[Any, Any, tuple[Any, ...]]:
    """``MemPool``, ``use_mem_pool`` and the bindings that route every thread to a pool (the
    ones ``use_mem_pool`` is built on, with the filter that takes every thread)."""
    cuda = torch.cuda
    mem_pool = getattr(cuda, "MemPool", None) or getattr(cuda.memory, "MemPool", None)
    use_mem_pool = getattr(cuda, "use_mem_pool", None) or getattr(cuda.memory, "use_mem_pool", None)
    bindings = tuple(getattr(torch._C, name, None) for name in _POOL_BINDINGS)
    if mem_pool is None or use_mem_pool is None or None in bindings:
        raise RuntimeError(
            f"rustws.torch.use_workspace needs torch.cuda.MemPool, torch.cuda.use_mem_pool and "
            f"torch._C.{', '.join(_POOL_BINDINGS)} (PyTorch >= 2.6); this is PyTorch {torch.__version__}"
        )
    return mem_pool, use_mem_pool, bindings


@contextlib.contextmanager
def _all_threads_to(bindings: tuple[Any, ...], ws: Any, ordinal: int, pool: Any) -> Iterator[None]:
    begin, end, release = bindings
    _rustws.torch_share(ws, ordinal)
    try:
        begin(ordinal, pool.id)
        try:
            yield
        finally:
            end(ordinal, pool.id)
            release(ordinal, pool.id)
    finally:
        _rustws.torch_unshare(ws, ordinal)


@contextlib.contextmanager
def use_workspace(ws: Any, *, all_threads: bool = True) -> Iterator[Any]:
    """Inside the block, PyTorch's CUDA allocations on the device of ``ws`` come from ``ws``:
    every thread's (the autograd engine's included) with ``all_threads``, else this thread's.
    Yields the ``torch.cuda.MemPool`` that serves them (one per workspace, kept across blocks)."""
    ordinal = _gpu_ordinal(ws, "rustws.torch.use_workspace")
    if not isinstance(all_threads, bool):
        raise TypeError(f"all_threads must be a bool, got {type(all_threads).__name__}")
    torch = _torch()
    mem_pool, use_mem_pool, bindings = _pool_api(torch)
    pool = ws.__dict__.get("_torch_pool")
    if pool is None:
        pool = ws._torch_pool = mem_pool(pluggable_allocator().allocator())
    _route(ws, ordinal)
    try:
        if all_threads:
            routed = _all_threads_to(bindings, ws, ordinal, pool)
        else:
            routed = use_mem_pool(pool, device=torch.device("cuda", ordinal))
        with routed:
            yield pool
    finally:
        _unroute(ws)


def held_by_torch() -> tuple[int, int]:
    """Blocks PyTorch holds from rustws workspaces, and their bytes."""
    return _rustws.torch_blocks()
