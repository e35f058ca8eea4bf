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
import itertools
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from . import _log
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
        # Set once, read by the producer between items: a plain flag, so that stopping takes no
        # lock an exception from a signal handler could leave held (`threading.Event` takes one).
        self.stopped = False
        # The items, and one credit per free place among them: the producer takes a credit before
        # it puts an item, the consumer gives one back for each item it takes. Both are the C
        # `SimpleQueue`, which an exception from a signal handler (Ctrl-C in the consumer) cannot
        # leave half locked, as it can `queue.Queue`'s Python lock and conditions.
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.credits: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(buffer_size):
            self.credits.put(None)
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
        while not self.stopped:
            try:
                self.credits.get(timeout=0.05)
            except queue.Empty:
                continue
            self.items.put(item)
            return True
        return False

    def take(self, timeout: float) -> Any:
        """The next item (``queue.Empty`` after ``timeout`` seconds without one)."""
        item = self.items.get(timeout=timeout)
        self.credits.put(None)
        return item

    def run(self) -> None:
        try:
            for item in self.source:
                if self.stopped:
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
            if self.stopped:
                self.drain()
                # Abandoned: nobody will consume what is left. Items already handed out stay valid.
                if self.workspace is not None:
                    self.workspace.destroy()

    def drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.items.get_nowait()


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
                item = self._producer.take(timeout=0.1)
                break
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._producer.items.empty():
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
        self._producer.stopped = True  # first: an interrupt landing later still stops the thread
        self._closed = True
        producer = self._producer
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
            producer.stopped = True


# -- garbage collection ---------------------------------------------------------------------------


# How long an idle collector thread waits for the next block before it ends: blocks opened one
# after another (a `gc_window` around each step of a loop) share one thread, and a loop that has
# finished leaves none behind.
_IDLE_S = 0.5


class _PeriodicCollector:
    """Python's automatic GC off, and a collection at most every window from a daemon thread,
    while periodic collection is wanted: switched on by ``toggle_periodic_gc(True)`` or by any
    open ``gc_window`` block, on any thread. Every change goes through ``_reconcile``, under one
    lock, from the state it keeps (the switch, the open blocks), never from what another thread
    found when it entered: blocks exit in any order and from any thread, and when the last one
    exits (and the switch is off) automatic GC is back as it was. The thread outlives the last
    block by ``_IDLE_S``, so that a block around each step of a loop does not start one per step."""

    def __init__(self) -> None:
        self.window_ms = 100  # set_auto_gc_window: the window of the switch
        self.collections = 0
        self._enabled = False  # toggle_periodic_gc
        # Open gc_window blocks: token -> (window in ms, the block's context manager, weakly, the
        # thread that opened it).
        self._blocks: dict[int, tuple[int, weakref.ref[Any], int]] = {}
        self._tokens = itertools.count(1)
        self._active = False  # automatic GC switched off by this collector
        self._was_enabled = True  # automatic GC when periodic collection started
        self._thread: threading.Thread | None = None  # the collector thread, while it runs
        self._timeout: float | None = None  # the window in force, in s; None: nothing wants one
        self._waiting: float | None = None  # the timeout the thread waits with (None: idle)
        # Put to make the thread read the window again. The C `SimpleQueue`: an exception from a
        # signal handler (Ctrl-C) cannot leave it locked, as it can leave the Python lock of a
        # `threading.Event`, which both threads would then wait for forever.
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._thread is not me:
                    return  # not the recorded thread (a start interrupted before recording it)
                timeout = self._waiting = self._timeout
            try:
                self._wake.get(timeout=_IDLE_S if timeout is None else timeout)
                continue  # the window changed: wait for the new one
            except queue.Empty:
                pass
            if timeout is None:
                # Idle for _IDLE_S: end, unless a change left half-made (an exception from a signal
                # handler in its reconciling) wants periodic collection after all.
                self._tidy()
                with self._lock:
                    if self._timeout is None and self._thread is me:
                        self._thread = None
                        return
                continue
            if self._active:
                try:
                    gc.collect()
                except Exception:  # a collection must never end periodic collection
                    _log.logger().exception("rustws: a periodic garbage collection raised")
                self.collections += 1
            self._tidy()

    def _tidy(self) -> None:
        """Drops the blocks whose context manager is gone without closing them, and reconciles:
        an exception from a signal handler (Ctrl-C) can land between a block's opening and its
        `with` body, or between a change and the reconciling of it, and must not leave Python's
        automatic GC off for good."""
        with self._lock:
            for token in [t for t, (_, owner, _) in self._blocks.items() if owner() is None]:
                del self._blocks[token]
            self._reconcile()

    def _reconcile(self) -> None:
        """Starts the thread if periodic collection is wanted and none runs, switches automatic GC
        to match, and makes the thread wait for the window in force now (a new window takes effect
        at once). Called with the lock held."""
        want = self._enabled or bool(self._blocks)
        # In an order that an exception from a signal handler, landing between any two steps,
        # leaves mended at the next reconcile (the thread's own, within a window): automatic GC is
        # off only while the thread waits for a window, and it reconciles at the end of each.
        if want:
            ms = next(reversed(self._blocks.values()))[0] if self._blocks else self.window_ms
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="rustws-gc", daemon=True)
                thread.start()
                self._thread = thread
            self._set_timeout(ms / 1000)
            if not self._active:
                self._was_enabled = gc.isenabled()
                self._active = True
                gc.disable()
        else:
            if self._active:
                if self._was_enabled:
                    gc.enable()
                self._active = False
            self._set_timeout(None)

    def _set_timeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        # The thread waits with `_waiting` (or is between waits and reads `_timeout` next). Waking
        # it only for a window it does not wait with already keeps a block around each step of a
        # loop from waking it twice a step; a block's end wakes it only from a window longer than
        # the idle wait, so that it ends within that wait.
        waiting = self._waiting
        to_window = timeout is not None and timeout != waiting
        to_idle = timeout is None and waiting is not None and waiting > _IDLE_S
        if to_window or to_idle:
            # The wake first: an exception from a signal handler between the two then costs a
            # spare wake, never a lost one.
            self._wake.put(None)
            self._waiting = timeout

    def _change(self, update: Callable[[], None]) -> None:
        with self._lock:
            try:
                update()
            finally:
                self._reconcile()

    def _after_fork_in_child(self) -> None:
        """The child has only the forking thread: no collector runs, and the lock may have been
        held by another thread at the fork. The blocks other threads had open end (no thread of
        the child will exit them); the forking thread's keep periodic collection, with a thread
        of the child's own."""
        self._lock = threading.Lock()
        self._wake = queue.SimpleQueue()
        self._thread = None
        self._timeout = self._waiting = None
        me = threading.get_ident()
        self._blocks = {t: b for t, b in self._blocks.items() if b[2] == me}
        if self._active or self._enabled or self._blocks:
            try:
                self._tidy()
            except Exception:  # a child that cannot start a thread keeps automatic GC as it is
                _log.logger().exception("rustws: periodic collection could not restart after a fork")

    def set_enabled(self, enabled: bool) -> None:
        def update() -> None:
            self._enabled = enabled

        self._change(update)

    def set_window(self, ms: int) -> None:
        def update() -> None:
            self.window_ms = ms

        self._change(update)

    def open_block(self, ms: int, owner: Any) -> int:
        token = next(self._tokens)

        def update() -> None:
            self._blocks[token] = (ms, weakref.ref(owner), threading.get_ident())

        self._change(update)
        return token

    def close_block(self, token: int) -> None:
        def update() -> None:
            self._blocks.pop(token, None)

        self._change(update)


_collector = _PeriodicCollector()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_collector._after_fork_in_child)

# The longest window: what a timed wait takes on every platform (a larger one used to kill the
# collector thread with OverflowError, and cyclic garbage was never collected again).
MAX_GC_WINDOW_MS = 2**31 - 1


def _check_ms(ms: Any) -> int:
    if isinstance(ms, bool) or not isinstance(ms, int):
        raise TypeError(f"window must be an int of milliseconds, got {type(ms).__name__}")
    if not 0 <= ms <= MAX_GC_WINDOW_MS:
        raise ValueError(f"invalid window: must be from 0 to {MAX_GC_WINDOW_MS} ms, got {ms}")
    return ms


def set_auto_gc_window(ms: int) -> None:
    """Collect at most every ``ms`` milliseconds while periodic GC is on; 0 turns the switch of
    ``toggle_periodic_gc`` off (open ``gc_window`` blocks keep theirs)."""
    ms = _check_ms(ms)
    if ms == 0:
        _collector.set_enabled(False)
        return
    _collector.set_window(ms)


def toggle_periodic_gc(enabled: bool) -> None:
    """On: Python's automatic GC is off and a collection runs every window. Off: back to Python's
    (once no ``gc_window`` block is open either)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _collector.set_enabled(enabled)


class _GcWindow(contextlib.ContextDecorator):
    """One ``gc_window`` block (see there); a decorator too, each call a block of its own."""

    def __init__(self, ms: int) -> None:
        self.ms = ms
        self.token: int | None = None

    def _recreate_cm(self) -> _GcWindow:
        return _GcWindow(self.ms)

    def __enter__(self) -> None:
        self.token = _collector.open_block(self.ms, self)

    def __exit__(self, *exc: object) -> None:
        token, self.token = self.token, None
        if token is not None:
            _collector.close_block(token)


def gc_window(ms: int) -> _GcWindow:
    """Inside: periodic GC every ``ms`` milliseconds instead of Python's automatic GC. Blocks may
    be open on several threads at once and exit in any order: the most recently opened one's
    window is in force, and when the last exits, what was there before (automatic GC, or the
    periodic collection of ``toggle_periodic_gc``) is back. A block whose context manager is
    dropped unclosed (an exception between its opening and its body) ends within a window."""
    ms = _check_ms(ms)
    if ms == 0:
        raise ValueError("invalid window: gc_window needs ms > 0")
    return _GcWindow(ms)
