"""Every rustws error subclasses the nearest built-in, hooks blame the device when the device is the
cause, and a refused captured allocation says why where it fails."""

from __future__ import annotations

import gc
import logging
import sys

import numpy as np
import pytest

import rustws
from rustws import (
    DeviceUnavailableError,
    DisposedArrayError,
    LeakedArrayError,
    NoSuchWorkspaceError,
    ScopeError,
    WorkspaceClosedError,
    WorkspaceError,
    WorkspaceOutOfMemory,
)

FAIL = rustws.WorkspaceConfiguration(initial_size="1MiB", policy_learning="NONE", policy_spill="FAIL")


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (WorkspaceOutOfMemory, MemoryError),
        (WorkspaceClosedError, RuntimeError),
        (ScopeError, RuntimeError),
        (LeakedArrayError, RuntimeError),
        (NoSuchWorkspaceError, KeyError),
        (DeviceUnavailableError, RuntimeError),
        (DisposedArrayError, RuntimeError),
    ],
)
def test_every_error_is_also_the_nearest_builtin(cls, builtin):
    assert issubclass(cls, WorkspaceError) and issubclass(cls, builtin)
    with pytest.raises(builtin, match="why"):
        raise cls("why")


def test_errors_raised_by_the_bindings_are_caught_as_builtins():
    ws = rustws.workspace("E")
    ws.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        ws.__enter__()
    other = rustws.workspace("E2")
    with pytest.raises(RuntimeError):  # ScopeError: not open
        other.__exit__(None, None, None)


def _fallback() -> rustws.DeviceWorkspace:
    with pytest.warns(RuntimeWarning, match="falling back"):
        ws = rustws.workspace("FALLBACK", device="cuda:99")
    assert isinstance(ws, rustws.DeviceWorkspace) and ws.fallback_reason
    return ws


def test_hooks_blame_the_device_for_a_host_fallback():
    ws = _fallback()
    with pytest.raises(DeviceUnavailableError, match=r"cuda:99.*unavailable"):
        rustws.torch.use_workspace(ws).__enter__()
    with pytest.raises(DeviceUnavailableError, match=r"cuda:99.*unavailable"):
        rustws.cupy.allocator(ws)
    # A host workspace is the wrong kind of argument, not a device problem.
    with pytest.raises(TypeError, match="device workspace"):
        rustws.cupy.allocator(rustws.workspace("HOST"))
    ws.destroy()
    with pytest.raises(WorkspaceClosedError, match="destroyed"):
        rustws.cupy.allocator(ws)


def test_a_refused_captured_allocation_carries_the_workspace_reason():
    ws = rustws.workspace("F", FAIL)
    with pytest.raises(MemoryError) as info, ws:
        np.ones(1 << 20)  # 8 MiB, in a 1 MiB arena that may not spill
    assert not isinstance(info.value, WorkspaceOutOfMemory)  # NumPy's own error ...
    notes = info.value.__notes__  # ... with the reason and the verdict attached
    assert len(notes) == 2 and "'F'" not in notes[0] and '"F"' in notes[0]
    assert "8388608 bytes" in notes[0] and "FAIL" in notes[0]
    assert notes[1].startswith("rustws verdict: the spill policy FAIL") and "8.0 MiB" in notes[1]


def test_a_refusal_caught_inside_the_cycle_is_logged(caplog):
    ws = rustws.workspace("F", FAIL)
    with caplog.at_level(logging.WARNING, logger="rustws"), ws:
        with pytest.raises(MemoryError):
            np.ones(1 << 20)
        assert not caplog.records  # reported when the cycle ends
    assert len(caplog.records) == 1 and "8388608 bytes" in caplog.records[0].getMessage()


def test_a_refusal_of_the_system_names_the_bytes_in_use_and_the_limit():
    ws = rustws.workspace("SYS", rustws.WorkspaceConfiguration(initial_size="1MiB"))
    with ws:
        arena = ws.stats().capacity_bytes
        kept = ws.empty(1 << 20, np.uint8)
        # More than a 64-bit process's address space: the system refuses whatever its overcommit.
        with pytest.raises(WorkspaceOutOfMemory) as info:
            ws.empty(1 << 48, np.uint8)
        del kept
    e = info.value
    assert e.system and e.reason == "the system refused memory"
    # Without a max_size, the limit named is the arena's capacity, as in the workspace's own refusals.
    assert (e.requested, e.in_use, e.limit) == (1 << 48, 1 << 20, arena) and arena >= 1 << 20
    assert f"cannot allocate {1 << 48} bytes: {1 << 20} bytes in use, limit {arena} bytes" in str(e)
    assert "the system refused memory: " in str(e) and e.__notes__[0].startswith("rustws verdict: the system")


@pytest.mark.parametrize("nbytes", [50_000, 100_000, 200_000, 3_000_000])
@pytest.mark.parametrize("field", ["initial_size", "max_size"])
def test_an_arena_or_limit_of_the_size_the_verdict_names_serves_the_request(field, nbytes):
    # The verdict counts the request as the workspace places it (its size class, a header, the
    # filler of a page-aligned block), not as asked: a workspace sized as it says serves it.
    from rustws._errors import _fmt

    def config(size):
        if field == "initial_size":
            return rustws.WorkspaceConfiguration(
                initial_size=size, policy_learning="NONE", policy_spill="FAIL", policy_allocation="STRICT"
            )
        return rustws.WorkspaceConfiguration(max_size=size, policy_spill="REALLOCATE")

    ws = rustws.workspace(f"TOO SMALL {field}", config(nbytes))
    with ws, pytest.raises(WorkspaceOutOfMemory) as info:
        ws.empty(nbytes, np.uint8)
    e = info.value
    ws.destroy()
    assert e.takes > nbytes and e.held == 0, e
    assert f"{field} to at least {_fmt(e.held + e.takes, up=True)}" in e.verdict or (
        f"{field} of at least {_fmt(e.held + e.takes, up=True)}" in e.verdict
    ), e.verdict
    assert e.largest_free < nbytes, e.verdict
    ws = rustws.workspace(f"AS ADVISED {field}", config(e.held + e.takes))
    with ws:  # exactly as large as it says: the check's own arrays come after
        a = ws.empty(nbytes, np.uint8)
    a[:] = 1
    assert int(a.sum()) == nbytes
    ws.destroy()


def test_the_verdict_counts_live_huge_blocks_whole_and_names_a_split_arena():
    # A live huge block takes its whole mapping (its class, a header, whole pages): a limit of
    # the size the verdict names holds it and the refused request.
    MiB = 1 << 20
    cfg = rustws.WorkspaceConfiguration(max_size=150 * MiB, policy_spill="EXTERNAL")
    ws = rustws.workspace("HUGE LIVE", cfg)
    with ws:
        first = ws.empty(100 * MiB, np.uint8)
        with pytest.raises(WorkspaceOutOfMemory) as info:
            ws.empty(100 * MiB, np.uint8)
        del first
    ws.destroy()
    e = info.value
    assert e.held > 100 * MiB and e.takes > 100 * MiB, e
    ws = rustws.workspace("HUGE AS ADVISED", rustws.WorkspaceConfiguration(max_size=e.held + e.takes))
    with ws:
        both = [ws.empty(100 * MiB, np.uint8) for _ in range(2)]
    assert all(rustws.owner(b) is ws for b in both)
    del both
    ws.destroy()

    # Under FAIL, with a run freed before a live block: an arena of the size the verdict names
    # serves the same steps.
    def split(initial_size):
        cfg = rustws.WorkspaceConfiguration(
            initial_size=initial_size, policy_allocation="STRICT", policy_learning="NONE", policy_spill="FAIL"
        )
        ws = rustws.workspace("SPLIT", cfg)
        try:
            with ws:
                big, small = ws.empty(MiB, np.uint8), ws.empty(64 << 10, np.uint8)
                del big
                ws.empty(1_500_000, np.uint8)
                del small
        finally:
            ws.destroy()

    with pytest.raises(WorkspaceOutOfMemory) as info:
        split(1_200_000)
    e = info.value
    assert "frees left runs too small" in e.verdict and e.live_end > e.held, e.verdict
    split(max(e.held, e.live_end) + e.takes)


def test_a_refused_like_allocation_of_a_subclass_leaves_its_dtype_alive():
    # NumPy 1's `empty_like` of a subclass released an explicit dtype once too often when its
    # allocation was refused (a crash once the dtype's count ran out): the prototype's dtype is
    # left to NumPy.
    cfg = rustws.WorkspaceConfiguration(initial_size="64KiB", policy_learning="NONE", policy_spill="FAIL")
    ws = rustws.workspace("SMALL LIKE", cfg)
    dt = np.dtype([("a", "f8"), ("b", "i4")])
    proto = np.ma.MaskedArray(np.zeros(1 << 17, dtype=dt))
    before = sys.getrefcount(dt)
    for _ in range(20):
        with ws, pytest.raises(MemoryError):
            ws.empty_like(proto)
    gc.collect()
    assert sys.getrefcount(dt) == before
    ws.destroy()


def test_a_refusal_whose_report_was_lost_says_so():
    # Where memory ran out again while a captured refusal's report was made, the error that
    # stands for it is the interpreter's bare MemoryError: the note says what is known.
    from rustws._workspace import _report_refusals

    try:
        raise MemoryError("Unable to allocate 8 MiB")
    except MemoryError as e:
        _report_refusals([MemoryError()])
        notes = e.__notes__
    assert len(notes) == 1 and notes[0].startswith("rustws: a request was refused"), notes
    assert "memory snapshot may be missing" in notes[0]
