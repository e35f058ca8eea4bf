"""Device workspaces without a usable GPU: the strict refusal with its reason, the host fallback
with DeviceArrays, and zero-copy exchange through DLPack and the array interface."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import rustws
from rustws import DeviceArray, DisposedArrayError, WorkspaceConfiguration

CFG = WorkspaceConfiguration(initial_size="1MiB")
NO_GPU = not rustws.cuda.is_available()
# A device that falls back on every machine: the first GPU without one, one past the last with.
FALLBACK = "cuda:0" if NO_GPU else f"cuda:{rustws.cuda.device_count()}"


def fallback(name="DEV", cfg=CFG, device=FALLBACK):
    with pytest.warns(RuntimeWarning, match="falling back to host memory"):
        return rustws.workspace(name, cfg, device=device)


@pytest.mark.skipif(not NO_GPU, reason="a usable GPU is present")
def test_no_gpu_means_not_available_with_a_reason():
    assert rustws.cuda.is_available() is False
    reason = rustws.cuda.unavailable_reason(0)
    assert reason and ("driver" in reason or "device" in reason or "backend" in reason)
    assert rustws.cuda.device_count() >= 0


@pytest.mark.skipif(not NO_GPU, reason="a usable GPU is present")
def test_strict_device_workspaces_raise_with_the_reason():
    strict = CFG.replace(helper_allow_fallback=False)
    with pytest.raises(rustws.DeviceUnavailableError, match=r"'cuda:1' is unavailable: .+"):
        rustws.workspace("STRICT", strict, device="cuda:1")
    assert rustws.get_workspace("STRICT") is None


@pytest.mark.parametrize("ordinal", [-1, "0", 1.0, True, 2**31, 2**64, 10**20])
def test_the_probe_refuses_bad_ordinals(ordinal):
    with pytest.raises(ValueError, match="ordinal"):
        rustws.cuda.unavailable_reason(ordinal)


@pytest.mark.parametrize(
    "device",
    [
        "cuda:x",
        "cuda:-1",
        "gpu",
        "cuda0",
        "cuda:" + "9" * 20,
        "cuda:2147483648",
        "cuda:\u00b2",
        "cuda:\u0663",
    ],
)
def test_bad_device_strings(device):
    with pytest.raises(ValueError, match="device"):
        rustws.workspace("BAD", CFG, device=device)


def test_fallback_runs_a_numpy_program_unchanged():
    ws = fallback()
    assert isinstance(ws, rustws.DeviceWorkspace)
    assert ws.device == "cpu" and ws.requested_device == FALLBACK and ws.fallback_reason
    assert rustws.workspace("DEV", CFG, device=FALLBACK) is ws  # same request, same workspace
    with ws:
        x = ws.full((4, 3), 2.0, np.float32)
        w = rustws.cuda.asarray(np.arange(12, dtype=np.float32).reshape(3, 4), ws)
        assert isinstance(x, DeviceArray) and x.device == "cpu"
        y = np.asarray(x) @ np.asarray(w)
        np.testing.assert_array_equal(y, np.full((4, 3), 2.0) @ np.arange(12).reshape(3, 4))
        z = ws.zeros(5, np.int64)
        assert not np.asarray(z).any()
        e = ws.empty_like(np.ones((2, 2)))
        assert e.shape == (2, 2) and e.dtype == np.float64
    assert rustws.owner(x) is ws
    assert x.shape == (4, 3) and x.dtype == np.float32 and x.strides == (12, 4) and x.nbytes == 48
    assert x.ndim == 2 and x.size == 12 and x.ptr == np.asarray(x).ctypes.data
    assert not hasattr(x, "__cuda_array_interface__")
    assert "DeviceArray(shape=(4, 3)" in repr(x)


def test_dlpack_and_array_interface_are_zero_copy():
    ws = fallback()
    with ws:
        a = ws.full(10, 1.0)
    assert a.__dlpack_device__() == (1, 0)
    via_dlpack = np.from_dlpack(a)
    via_interface = np.asarray(a)
    assert np.shares_memory(via_dlpack, via_interface)
    via_interface[3] = 42.0  # (NumPy 1 reads DLPack capsules as read-only arrays)
    assert via_dlpack[3] == 42.0 and np.asarray(a)[3] == 42.0
    with pytest.raises(BufferError):
        a.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        a.__dlpack__(stream=5)


def test_to_numpy_copy_from_and_dispose():
    ws = fallback()
    with ws:
        a = ws.zeros(4)
    a.copy_from([1, 2, 3, 4])
    host = a.to_numpy()
    assert rustws.owner(host) is None
    host[0] = 99
    assert np.asarray(a)[0] == 1
    with pytest.raises(ValueError, match="shape"):
        a.copy_from(np.ones(5))
    a.dispose()
    a.dispose()  # idempotent
    assert a.is_disposed and rustws.owner(a) is None
    for use in (lambda: a.shape, lambda: np.asarray(a), lambda: a.to_numpy(), lambda: a.__dlpack__()):
        with pytest.raises(DisposedArrayError):
            use()
    assert "disposed" in repr(a)


def test_exported_views_outlive_dispose():
    ws = fallback()
    with ws:
        a = ws.full(1000, 7.0)
    view = np.from_dlpack(a)
    a.dispose()
    with ws:
        ws.full(1000, -1.0)  # the freed block may not be reused while the view lives
    assert (view == 7.0).all()


def test_asarray_needs_a_workspace():
    with pytest.raises(TypeError):
        rustws.cuda.asarray([1, 2], "DEV")
    host_ws = rustws.workspace("HOST", CFG)
    with host_ws:
        d = rustws.cuda.asarray([1, 2], host_ws)
    assert isinstance(d, DeviceArray) and d.device == "cpu"


# -- views of host DeviceArrays outlive dispose ----------------------------------------------------


class _InterfaceConsumer:
    """A consumer of ``__array_interface__`` alone (as libraries without the buffer protocol read
    it): it keeps the array, and points into its memory."""

    def __init__(self, d):
        self.d = d
        self.__array_interface__ = d.__array_interface__


VIEWS = {
    "__array_interface__ consumer": lambda d: np.asarray(_InterfaceConsumer(d)),
    "np.asarray": lambda d: np.asarray(d),
    "np.array(copy=False)": lambda d: np.array(d, copy=False),
    "__array__": lambda d: d.__array__(),
    "memoryview": lambda d: memoryview(d),
    "np.frombuffer": lambda d: np.frombuffer(d, dtype=np.float64),
    "np.asarray(memoryview)": lambda d: np.asarray(memoryview(d)),
    "np.from_dlpack": lambda d: np.from_dlpack(d),
    "view of a view": lambda d: np.asarray(d)[2:][::2],
}


def _dispose(d, how):
    if how == "dispose":
        d.dispose()
    elif how == "dispose_scope":
        with rustws.dispose_scope() as scope:
            scope.attach(d)
        assert d.is_disposed
    else:  # the DeviceArray object itself goes away
        del d


def _host_workspaces():
    yield "fallback", fallback("VIEWS")
    host_only = CFG.replace(policy_mirroring="HOST_ONLY")
    yield "HOST_ONLY", rustws.workspace("VIEWS_HOST_ONLY", host_only, device="cuda:0")


@pytest.mark.parametrize("how", ["dispose", "dispose_scope", "del"])
@pytest.mark.parametrize("make_view", VIEWS.values(), ids=VIEWS.keys())
def test_a_view_of_a_host_device_array_keeps_its_memory(make_view, how):
    """The safety rule for every zero-copy view of a host DeviceArray: after ``dispose()``, leaving
    a dispose scope or the array's death, the view keeps its values and its memory is never
    handed out again while the view lives."""
    for name, ws in _host_workspaces():
        with ws:
            d = ws.full(64, 5.0, np.float64)
            view = make_view(d)
            values = np.asarray(view, dtype=np.float64)
            start = np.asarray(view).ctypes.data if not isinstance(view, memoryview) else None
            _dispose(d, how)
            del d
            gc.collect()
            for _ in range(4):
                fresh = [ws.zeros(64, np.float64), ws.full(64, -1.0, np.float64)]
                for f in fresh:
                    assert np.asarray(f).ctypes.data != start, f"{name}: memory reused under a view"
            assert (np.asarray(view, dtype=np.float64) == values).all(), f"{name}: the view's values changed"
            del view, fresh


def test_memoryview_of_a_host_device_array_is_zero_copy_and_writable():
    ws = fallback()
    with ws:
        d = ws.zeros((3, 4), np.float32)
    m = memoryview(d)
    assert (m.shape, m.format, m.readonly, m.nbytes) == ((3, 4), "f", False, 48)
    np.asarray(m)[1, 2] = 9.0
    assert np.asarray(d)[1, 2] == 9.0
    d.dispose()
    with pytest.raises(DisposedArrayError):
        memoryview(d)
