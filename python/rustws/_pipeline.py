"""The data pipeline and garbage-collection control of a training loop.

``AsyncPrefetch`` runs the source iterator on a background thread and copies each item (an array,
or a tuple / list / dict of arrays) into a cyclic workspace of that thread, at most ``buffer_size``
items ahead; the consumer gets the copies in order. Items the consumer keeps stay valid: their
blocks stay pinned until they die. ``AsyncShield`` marks an iterable that must not be prefetched.

The GC functions replace Python's allocation-count-driven cyclic collector with collections at most
every ``window`` milliseconds, from a background thread, while periodic collection is on.
"""

from __future__ import annotations

import contextlib
import gc
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ._config import ResetPolicy, SpillPolicy, WorkspaceConfiguration
from ._workspace import Workspace, workspace

__all__ = ["AsyncPrefetch", "AsyncShield", "gc_window", "set_auto_gc_window", "toggle_periodic_gc"]

_END = object()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class AsyncShield:
    """Wraps an iterable so that ``AsyncPrefetch`` iterates it in the consumer's thread, unchanged."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


def _nbytes(item: Any) -> int:
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, (tuple, list)):
        return sum(_nbytes(x) for x in item)
    if isinstance(item, dict):
        return sum(_nbytes(x) for x in item.values())
    return 0


def _copy_into(ws: Workspace, item: Any) -> Any:
    if isinstance(item, np.ndarray):
        if item.dtype.hasobject:
            return item.copy()
        return ws._copy_of(item)  # of the item's subclass, as np.copy(subok=True)
    if isinstance(item, tuple):
        return tuple(_copy_into(ws, x) for x in item)
    if isinstance(item, list):
        return [_copy_into(ws, x) for x in item]
    if isinstance(item, dict):
        return {k: _copy_into(ws, v) for k, v in item.items()}
    return item


class _Producer:
    """What the background thread of an ``AsyncPrefetch`` works with. The thread holds this, never
    the ``AsyncPrefetch`` itself, so a consumer that stops early (``break``) and drops its iterator
    lets it be finalised, which stops the thread."""

    def __init__(
        self, source: Iterator[Any], buffer_size: int, config: WorkspaceConfiguration | None
    ) -> None:
        self.source = source
        self.buffer_size = buffer_size
        self.config = config
        self.stop = threading.Event()
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=buffer_size)
        self.workspace: Workspace | None = None

    def _workspace_for(self, first: Any) -> Workspace:
        cfg = self.config
        if cfg is None:
            size = max(_nbytes(first) * (self.buffer_size + 2), 1 << 20)
            cfg = WorkspaceConfiguration(
                initial_size=size,
                policy_learning="NONE",
                policy_reset=ResetPolicy.ENDOFBUFFER_REACHED,
                policy_spill=SpillPolicy.REALLOCATE,
            )
        return workspace(f"PREFETCH-{id(self):x}", cfg, capture=False)

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            for item in self.source:
                if self.stop.is_set():
                    break
                ws = self.workspace
                if ws is None:
                    ws = self.workspace = self._workspace_for(item)
                with ws:
                    copy = _copy_into(ws, item)
                del item
                if not self.put(copy):
                    break
            else:
                self.put(_END)
        except BaseException as error:  # re-raised in the consumer
            self.put(_Failure(error))
        finally:
            if self.stop.is_set():
                self.drain()
                # Abandoned: nobody will consume what is left. Items already handed out stay valid.
                if self.workspace is not None:
                    self.workspace.destroy()

    def drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait()


class AsyncPrefetch:
    """Prefetches ``iterable`` on a background thread into a cyclic workspace.

    An iterator and a context manager; ``close()`` stops the thread, and so does dropping the
    iterator (a ``for`` loop left by ``break``). Errors in the source re-raise in the consumer,
    with their traceback.
    """

    def __init__(
        self, iterable: Iterable[Any], *, buffer_size: int = 4, config: WorkspaceConfiguration | None = None
    ) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int):
            raise TypeError(f"buffer_size must be an int, got {type(buffer_size).__name__}")
        if buffer_size < 1:
            raise ValueError(f"invalid buffer_size: must be >= 1, got {buffer_size}")
        if config is not None and not isinstance(config, WorkspaceConfiguration):
            raise TypeError(f"config must be a WorkspaceConfiguration or None, got {type(config).__name__}")
        self.buffer_size = buffer_size
        self._closed = False
        self._shielded = isinstance(iterable, AsyncShield)
        source = iter(iterable)  # raises TypeError for a non-iterable, here in the caller
        self._source = source if self._shielded else None
        self._producer = _Producer(source, buffer_size, config)
        self._thread: threading.Thread | None = None
        if not self._shielded:
            self._thread = threading.Thread(target=self._producer.run, name="rustws-prefetch", daemon=True)
            self._thread.start()

    @property
    def workspace(self) -> Workspace | None:
        """The cyclic workspace the items are copied into (made from the first item)."""
        return self._producer.workspace

    # -- consumer ---------------------------------------------------------------------------------
    def __iter__(self) -> AsyncPrefetch:
        return self

    def __next__(self) -> Any:
        if self._source is not None:
            return next(self._source)
        if self._closed:
            raise StopIteration
        while True:
            try:
                item = self._producer.queue.get(timeout=0.1)
                break
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._producer.queue.empty():
                    self._closed = True
                    raise StopIteration from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stops the background thread and drops what it prefetched. Idempotent."""
        self._closed = True
        producer = self._producer
        producer.stop.set()
        producer.drain()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if producer.workspace is not None and not self.is_alive:
            producer.workspace.destroy()  # items the consumer still holds stay valid

    @property
    def is_alive(self) -> bool:
        """Whether the background thread still runs."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> AsyncPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without close(): the thread sees the flag within one queue timeout and ends.
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.stop.set()


# -- garbage collection ---------------------------------------------------------------------------


class _PeriodicCollector:
    """Python's automatic GC off; a collection at most every ``window_ms`` from a daemon thread."""

    def __init__(self) -> None:
        self.window_ms = 100
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._was_enabled = True
        self._lock = threading.Lock()
        self.collections = 0

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _run(self, stop: threading.Event, window_s: float) -> None:
        while not stop.wait(window_s):
            gc.collect()
            self.collections += 1

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop, self.window_ms / 1000), name="rustws-gc", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            if self._thread is None:
                return
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
            if self._was_enabled:
                gc.enable()


_collector = _PeriodicCollector()


def _check_ms(ms: Any) -> int:
    if isinstance(ms, bool) or not isinstance(ms, int):
        raise TypeError(f"window must be an int of milliseconds, got {type(ms).__name__}")
    if ms < 0:
        raise ValueError(f"invalid window: must be >= 0 ms, got {ms}")
    return ms


def set_auto_gc_window(ms: int) -> None:
    """Collect at most every ``ms`` milliseconds while periodic GC is on; 0 turns it off."""
    ms = _check_ms(ms)
    if ms == 0:
        _collector.stop()
        return
    running = _collector.running
    _collector.stop()
    _collector.window_ms = ms
    if running:
        _collector.start()


def toggle_periodic_gc(enabled: bool) -> None:
    """On: Python's automatic GC is off and a collection runs every window. Off: back to Python's."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if enabled:
        _collector.start()
    else:
        _collector.stop()


@contextlib.contextmanager
def gc_window(ms: int) -> Iterator[None]:
    """Inside: periodic GC every ``ms`` milliseconds instead of Python's automatic GC."""
    ms = _check_ms(ms)
    if ms == 0:
        raise ValueError("invalid window: gc_window needs ms > 0")
    was_running, old_window = _collector.running, _collector.window_ms
    _collector.stop()
    _collector.window_ms = ms
    _collector.start()
    try:
        yield
    finally:
        _collector.stop()
        _collector.window_ms = old_window
        if was_running:
            _collector.start()
