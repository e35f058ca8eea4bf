"""A scope hands what its workspace does not take (small requests, other threads, a closed scope)
to the handler below it exactly as that handler would serve it: same size, no header, no byte
written outside the block. NEP 49 promises nothing of a handler's alignment, so the handler below
here returns addresses at 8 mod 16 and guards every block with canaries on both sides; every block
it served must come back to it, once, with the size it was asked for, canaries intact."""

from __future__ import annotations

import ctypes
import gc
import threading

import numpy as np
import pytest

import rustws
from rustws import WorkspaceConfiguration, _rustws

CANARY = 0xA7
GUARD = 24  # canary bytes on each side


class Allocator(ctypes.Structure):
    MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    CALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
    REALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    _fields_ = [
        ("ctx", ctypes.c_void_p),
        ("malloc", MALLOC),
        ("calloc", CALLOC),
        ("realloc", REALLOC),
        ("free", FREE),
    ]


class Handler(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", Allocator)]


libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Tracking:
    """A handler whose blocks start at 8 mod 16, with canaries around each one."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}  # address -> (raw allocation, size)
        self.errors: list[str] = []
        self.served = 0
        self.lock = threading.Lock()
        self._callbacks = (
            Allocator.MALLOC(lambda ctx, n: self._malloc(n)),
            Allocator.CALLOC(lambda ctx, k, n: self._malloc(k * n, zeroed=True)),
            Allocator.REALLOC(lambda ctx, p, n: self._realloc(p, n)),
            Allocator.FREE(lambda ctx, p, n: self._free(p, n)),
        )
        self.handler = Handler(b"tracking-8-mod-16", 1, Allocator(None, *self._callbacks))
        self.capsule = ctypes.pythonapi.PyCapsule_New(ctypes.addressof(self.handler), b"mem_handler", None)

    def _malloc(self, n: int, zeroed: bool = False) -> int | None:
        raw = libc.malloc(n + 2 * GUARD + 16)
        if not raw:
            return None
        p = raw + GUARD + (8 - (raw + GUARD) % 16) % 16
        assert p % 16 == 8
        ctypes.memset(p - GUARD, CANARY, GUARD)
        ctypes.memset(p + n, CANARY, GUARD)
        if zeroed:
            ctypes.memset(p, 0, n)
        with self.lock:
            self.live[p] = (raw, n)
            self.served += 1
        return p

    def _check(self, p: int, n: int, what: str) -> None:
        before = ctypes.string_at(p - GUARD, GUARD)
        after = ctypes.string_at(p + n, GUARD)
        if before != bytes([CANARY]) * GUARD or after != bytes([CANARY]) * GUARD:
            self.errors.append(f"{what}: a canary of the {n}-byte block at {p:#x} was overwritten")

    def _free(self, p: int | None, n: int) -> None:
        if not p:
            return
        with self.lock:
            entry = self.live.pop(p, None)
        if entry is None:
            self.errors.append(f"free of {p:#x}, which this handler did not serve (or served once)")
            return
        raw, size = entry
        if size != n:
            self.errors.append(f"free of {p:#x} with {n} bytes; it was served for {size}")
        self._check(p, size, "free")
        libc.free(raw)

    def _realloc(self, p: int | None, n: int) -> int | None:
        if not p:
            return self._malloc(n)
        with self.lock:
            entry = self.live.get(p)
        if entry is None:
            self.errors.append(f"realloc of {p:#x}, which this handler did not serve")
            return None
        q = self._malloc(n)
        if q:
            ctypes.memmove(q, p, min(n, entry[1]))
            self._free(p, entry[1])
        return q

    def check_all(self) -> None:
        with self.lock:
            for p, (_, n) in self.live.items():
                self._check(p, n, "live")


@pytest.fixture
def below():
    """The tracking handler, current in this context (below any scope opened in the test)."""
    t = Tracking()
    previous = _rustws.set_handler(t.capsule)
    try:
        yield t
    finally:
        gc.collect()
        _rustws.set_handler(previous)
        assert not t.errors, t.errors


def fill_and_check(arrays):
    for i, a in enumerate(arrays):
        a.view(np.uint8)[...] = (i * 7 + 3) % 251
    for i, a in enumerate(arrays):
        assert (a.view(np.uint8) == (i * 7 + 3) % 251).all()


def test_small_requests_go_below_the_scope_exactly_as_asked(below):
    ws = rustws.workspace("BELOW", WorkspaceConfiguration(initial_size="4MiB", helper_min_size="8KiB"))
    with ws:
        arrays = [np.empty(n, np.uint8) for n in (1, 7, 8, 15, 16, 100, 911, 912, 1000, 4000, 8191)]
        arrays += [np.ones(n // 8) for n in range(64, 8192, 640)]
        big = np.ones(16 << 10)
        assert rustws.owner(big) is ws
        for a in arrays:
            assert rustws.owner(a) is None and a.ctypes.data % 16 == 8, "not served by the handler below"
        fill_and_check(arrays)
        below.check_all()
        del arrays, a
    assert below.served > 20
    gc.collect()
    assert not below.live, f"{len(below.live)} blocks never came back to the handler below"


def test_resizes_keep_a_block_with_the_handler_that_served_it(below):
    ws = rustws.workspace("RESIZE", WorkspaceConfiguration(initial_size="4MiB", helper_min_size="8KiB"))
    with ws:
        small = np.ones(100, np.uint8)
        small.resize(5000, refcheck=False)  # still small: resized below
        grown = np.ones(100, np.uint8)
        grown.resize(64 << 10, refcheck=False)  # past helper_min_size: stays with its handler
        ours = np.ones(16 << 10)
        ours.resize(100, refcheck=False)  # a workspace block shrunk past helper_min_size
        for a in (small, grown, ours):
            a.view(np.uint8)[...] = 5
        below.check_all()
        assert rustws.owner(small) is None and rustws.owner(grown) is None
    del small, grown, ours, a
    gc.collect()
    assert not below.live


def test_other_threads_and_a_closed_scope_are_served_below(below):
    ws = rustws.workspace("ELSEWHERE", WorkspaceConfiguration(initial_size="4MiB"))
    elsewhere: list[np.ndarray] = []

    def other_thread() -> None:
        elsewhere.append(np.ones(20_000))

    with ws:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        mine = np.ones(20_000)
    after = np.ones(20_000)  # the closed scope is still in place: it hands this below
    assert rustws.owner(mine) is ws and rustws.owner(elsewhere[0]) is None and rustws.owner(after) is None
    fill_and_check([elsewhere[0], mine, after])
    below.check_all()
    elsewhere.clear()
    del mine, after
    gc.collect()
    assert not below.live
