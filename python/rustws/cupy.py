"""CuPy integration: ``cupy.cuda.set_allocator(rustws.cupy.allocator(ws))`` serves every CuPy
allocation from the device workspace ``ws``.

Each allocation is one workspace block wrapped in ``cupy.cuda.UnownedMemory`` whose owner is the
block itself, so the memory returns to the workspace when CuPy drops its last pointer to it, and
is never handed out before. Open cycles of ``ws`` around a loop (``with ws:``) and its arena serves
every iteration after the first. As with CuPy's own pool, a block is reused in stream order: one
allocated while a non-default stream is current goes back to the workspace only after the work
queued on that stream when CuPy dropped it has finished.

CuPy is not a dependency of rustws: it is imported when the allocator is made, with a clear error
when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .cuda import _gpu_ordinal

__all__ = ["allocator"]


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise ImportError("rustws.cupy needs CuPy, which is not installed (pip install cupy-cuda12x)") from e
    return cupy


def allocator(ws: Any) -> Callable[[int], Any]:
    """An allocator for ``cupy.cuda.set_allocator`` (and ``cupy.cuda.using_allocator``)."""
    ordinal = _gpu_ordinal(ws, "rustws.cupy.allocator")
    cupy = _cupy()
    unowned = cupy.cuda.memory.UnownedMemory
    pointer = cupy.cuda.memory.MemoryPointer
    current_stream = cupy.cuda.get_current_stream
    buffer = ws._buffer

    def allocate(size: int) -> Any:
        buf = buffer(size)
        stream = current_stream().ptr
        if stream:  # not the legacy default stream, which orders itself
            buf.order_before(stream)
        return pointer(unowned(buf.ptr, size, buf, ordinal), 0)

    allocate.workspace = ws  # type: ignore[attr-defined]
    return allocate
