"""The device code path on a machine without a GPU: device workspaces over a host stand-in for
device memory (the workspace keeps its headers apart and touches the memory only through the
backend), so DeviceArrays, the CUDA array interface, DLPack capsules, mirroring, dispose and the
framework allocator hooks run here exactly as they do on a GPU, except for the driver calls."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import types

import numpy as np
import pytest

import rustws
from rustws import (
    DeviceArray,
    DisposedArrayError,
    MirroringPolicy,
    SpillPolicy,
    WorkspaceConfiguration,
    WorkspaceOutOfMemory,
    _rustws,
)
from rustws.cuda import _standin_workspace

CFG = WorkspaceConfiguration(initial_size="1MiB", policy_mirroring="DISABLED")


def dev(name="DEV", cfg=CFG, dl_device=(2, 0)):
    return _standin_workspace(name, cfg, dl_device=dl_device)


# -- DLPack structures, to read capsules as a consumer does -------------------------------------------
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
# The consumed capsule's new name must outlive it.
_USED = {
    b"dltensor": ctypes.c_char_p(b"used_dltensor"),
    b"dltensor_versioned": ctypes.c_char_p(b"used_dltensor_versioned"),
}


def consume(capsule, versioned):
    """Takes the tensor out of a capsule as a DLPack consumer does; returns (managed, tensor)."""
    name = b"dltensor_versioned" if versioned else b"dltensor"
    ptr = _get_pointer(capsule, name)
    assert ptr
    assert _set_name(capsule, _USED[name]) == 0
    kind = DLManagedTensorVersioned if versioned else DLManagedTensor
    managed = ctypes.cast(ptr, ctypes.POINTER(kind)).contents
    return managed, managed.dl_tensor


# -- arrays over (stand-in) device memory ----------------------------------------------------------
def test_device_arrays_live_in_the_workspace_and_refuse_implicit_host_use():
    ws = dev()
    assert ws.backend_name.startswith("opaque") and not ws.host_accessible
    with ws:
        a = ws.empty((3, 4), np.float32)
        assert isinstance(a, DeviceArray) and a.device == "cuda:0"
        assert a.shape == (3, 4) and a.dtype == np.float32 and a.strides == (16, 4)
        assert a.nbytes == 48 and a.ndim == 2 and a.size == 12 and len(a) == 3
        assert a.ptr % 256 == 0, "device buffers keep cudaMalloc's 256-byte alignment"
        assert rustws.owner(a) is ws
        assert ws.stats().used_bytes >= 48
        assert not hasattr(a, "__array_interface__")
        with pytest.raises(TypeError, match="to_numpy"):
            np.asarray(a)
        with pytest.raises(BufferError, match="to_numpy"):
            memoryview(a)  # device memory has no host buffer
        with pytest.raises(TypeError, match="holds Python objects"):
            ws.empty(3, object)
        with pytest.raises(ValueError, match="order"):
            ws.empty(3, order="K")
        with pytest.raises(ValueError, match="negative"):
            ws.empty((2, -1))
        with pytest.raises(TypeError, match="shape"):
            ws.empty("3")


def test_cuda_array_interface_v3():
    ws = dev()
    with ws:
        c = ws.zeros((2, 5), np.int16)
        f = ws.zeros((2, 5), np.float64, order="F")
        z = ws.empty((0, 3))
    ci = c.__cuda_array_interface__
    assert ci == {
        "shape": (2, 5),
        "typestr": np.dtype(np.int16).str,
        "descr": [("", np.dtype(np.int16).str)],
        "data": (c.ptr, False),
        "strides": None,
        "version": 3,
        "stream": 1,
    }
    fi = f.__cuda_array_interface__
    assert fi["strides"] == (8, 16) and f.strides == (8, 16)
    assert z.__cuda_array_interface__["data"] == (0, False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.uint8, np.complex64, np.bool_])
@pytest.mark.parametrize("order", ["C", "F"])
def test_to_numpy_and_copy_from_round_trip(dtype, order):
    ws = dev()
    src = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    with ws:
        a = ws.empty(src.shape, dtype, order=order)
        assert a.copy_from(src) is a
        back = a.to_numpy()
    assert back.dtype == dtype and rustws.owner(back) is None
    np.testing.assert_array_equal(back, src)
    assert back.flags.f_contiguous if order == "F" else back.flags.c_contiguous
    back[0, 0, 0] = 1
    np.testing.assert_array_equal(a.to_numpy(), src)  # an independent copy


def test_copy_from_checks_shape_and_casting():
    ws = dev()
    with ws:
        a = ws.zeros(4, np.int32)
    a.copy_from(np.array([1, 2, 3, 4], np.int8))  # a safe cast
    np.testing.assert_array_equal(a.to_numpy(), [1, 2, 3, 4])
    a.copy_from(np.arange(8, dtype=np.int32)[::2])  # a strided source is staged
    np.testing.assert_array_equal(a.to_numpy(), [0, 2, 4, 6])
    with pytest.raises(ValueError, match="shape"):
        a.copy_from(np.ones(5))
    with pytest.raises(TypeError, match="cast"):
        a.copy_from(np.ones(4, np.complex128))


def test_zeros_and_full_are_exact_on_reused_memory():
    ws = dev(cfg=CFG.replace(initial_size="64KiB"))
    for _ in range(3):
        with ws:
            dirty = ws.full(4096, 255, np.uint8)
            assert dirty.to_numpy().min() == 255
            del dirty
            z = ws.zeros(4096, np.uint8)
            assert not z.to_numpy().any()
            f = ws.full((8, 8), 2.5, np.float32)
            assert (f.to_numpy() == 2.5).all()
            del z, f
    assert ws.stats().spill_count == 0


def test_external_spill_and_limits_on_the_device():
    cfg = CFG.replace(initial_size="64KiB", policy_learning="NONE", policy_spill=SpillPolicy.EXTERNAL)
    ws = dev(cfg=cfg)
    with ws:
        big = ws.empty(1 << 20, np.uint8)  # larger than the arena: a plain device allocation
        s = ws.stats()
        assert s.spill_count == 1 and s.external_bytes >= 1 << 20
        big.copy_from(np.full(1 << 20, 9, np.uint8))
        assert (big.to_numpy() == 9).all()
        del big
    assert ws.stats().external_bytes == 0
    capped = dev("CAP", cfg=cfg.replace(max_size="128KiB"))
    with capped, pytest.raises(WorkspaceOutOfMemory, match="max_size"):
        capped.empty(1 << 20, np.uint8)
    assert capped.stats().failed_allocations == 1


def test_device_workspaces_never_capture_numpy():
    ws = dev()
    assert ws.capture is False
    ws.capture = True
    assert ws.capture is False, "NumPy arrays in device memory would crash the first read"
    with ws:
        h = np.ones(1000)
        assert rustws.owner(h) is None
        assert rustws.current_workspace() is ws
        with pytest.raises(TypeError, match="device memory"):
            ws._ndarray(3)  # NumPy arrays never live in device memory
    previous = _rustws.set_handler(ws.handler)
    try:
        with pytest.raises(MemoryError):
            np.empty(10_000)
    finally:
        _rustws.set_handler(previous)


# -- DLPack ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_capsules_describe_the_device_array(versioned):
    ws = dev()
    with ws:
        a = ws.empty((3, 5), np.float32, order="F")
        b = ws.empty(4, np.bool_)
    cap = a.__dlpack__(max_version=(1, 0) if versioned else None)
    assert f'"{"dltensor_versioned" if versioned else "dltensor"}"' in repr(cap)
    managed, t = consume(cap, versioned)
    if versioned:
        assert (managed.version.major, managed.version.minor) == (1, 0) and managed.flags == 0
    assert (t.device.device_type, t.device.device_id) == (2, 0) == a.__dlpack_device__()
    assert t.data == a.ptr and t.byte_offset == 0 and t.ndim == 2
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)
    assert [t.shape[i] for i in range(2)] == [3, 5]
    assert [t.strides[i] for i in range(2)] == [1, 3]  # elements, Fortran order
    managed.deleter(ctypes.pointer(managed))
    bt = consume(b.__dlpack__(), False)[1]
    assert (bt.dtype.code, bt.dtype.bits) == (6, 8)


def test_a_dlpack_consumer_keeps_the_memory_alive():
    ws = dev()
    with ws:
        a = ws.full(1000, 7.0)
        cap = a.__dlpack__()
    used = ws.stats().used_bytes
    a.dispose()
    assert ws.stats().used_bytes == used, "the capsule still owns the buffer"
    managed, _ = consume(cap, False)
    del cap
    gc.collect()
    assert ws.stats().used_bytes == used, "the consumer's tensor still owns the buffer"
    managed.deleter(ctypes.pointer(managed))
    assert ws.stats().used_bytes == 0


def test_an_unconsumed_capsule_releases_its_reference():
    ws = dev()
    with ws:
        a = ws.empty(100)
    caps = [a.__dlpack__(), a.__dlpack__(max_version=(1, 1))]
    del a
    assert ws.stats().used_bytes > 0
    del caps
    gc.collect()
    assert ws.stats().used_bytes == 0


def test_dlpack_arguments_are_checked():
    ws = dev()
    with ws:
        a = ws.empty(4, np.float32)
        s = ws.empty(2, "S4")
    for stream in (-1, 1, 2, 0x7F00):
        a.__dlpack__(stream=stream)  # the stand-in has no driver stream to order
    with pytest.raises(ValueError, match="stream"):
        a.__dlpack__(stream=0)
    with pytest.raises(TypeError, match="stream"):
        a.__dlpack__(stream="default")
    with pytest.raises(BufferError, match="device"):
        a.__dlpack__(dl_device=(1, 0))
    with pytest.raises(TypeError, match="max_version"):
        a.__dlpack__(max_version=1)
    with pytest.raises(TypeError, match="dl_device"):
        a.__dlpack__(dl_device="cuda")
    with pytest.raises(BufferError, match="DLPack"):
        s.__dlpack__()
    with ws:
        swapped = ws.empty(3, ">f8" if sys.byteorder == "little" else "<f8")
        wide = ws.empty(3, np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else swapped
    for unsupported in (swapped, wide):  # consumers would misread them
        with pytest.raises(BufferError, match="DLPack"):
            unsupported.__dlpack__()


def test_numpy_consumes_the_capsules_zero_copy():
    # A stand-in that reports a CPU DLPack device, so a real consumer (NumPy) reads the capsules.
    ws = dev(dl_device=(1, 0))
    with ws:
        a = ws.zeros((4, 6), np.float64, order="F")
        a.copy_from(np.arange(24.0).reshape(4, 6))
    view = np.from_dlpack(a)
    assert view.ctypes.data == a.ptr and view.flags.f_contiguous
    np.testing.assert_array_equal(view, np.arange(24.0).reshape(4, 6))
    ctypes.c_double.from_address(a.ptr).value = -5.0  # (NumPy 1's DLPack arrays are read-only)
    assert view[0, 0] == -5.0 and a.to_numpy()[0, 0] == -5.0

    class Legacy:  # a producer that takes no keywords (NumPy reads the methods off the type)
        def __dlpack__(self, **kw):
            return a.__dlpack__()

        def __dlpack_device__(self):
            return a.__dlpack_device__()

    legacy = np.from_dlpack(Legacy())
    assert legacy.ctypes.data == a.ptr
    copied = np.from_dlpack(a, copy=True) if np.lib.NumpyVersion(np.__version__) >= "2.1.0" else None
    if copied is not None:
        assert copied.ctypes.data != a.ptr
        np.testing.assert_array_equal(copied, view)
    with pytest.raises(BufferError):
        a.__dlpack__(stream=5)


# -- mirroring ---------------------------------------------------------------------------------------
def test_full_mirroring_keeps_a_host_mirror_that_follows_the_cycles():
    ws = dev("MIR", CFG.replace(policy_mirroring=MirroringPolicy.FULL))
    mirror_ws = ws._mirror_ws
    assert mirror_ws is not None and mirror_ws.host_accessible
    with ws:
        assert mirror_ws.is_open and rustws.current_workspace() is ws
        a = ws.zeros((2, 3), np.int32)
        host = a.host
        assert isinstance(host, np.ndarray) and rustws.owner(host) is mirror_ws
        a.copy_from(np.arange(6).reshape(2, 3))  # staged through the mirror
        np.testing.assert_array_equal(a.sync_to_host(), np.arange(6).reshape(2, 3))
        a.host[1, 2] = 50
        a.sync_to_device()
        assert a.to_numpy()[1, 2] == 50
        assert a.host is host
        del a, host
    assert not mirror_ws.is_open and mirror_ws.generation == ws.generation == 1
    ws.destroy()
    assert mirror_ws.is_destroyed


@pytest.mark.parametrize("leave", ["exhaust", "break", "raise"])
def test_the_loop_form_opens_and_closes_the_mirrors_cycles(leave):
    ws = dev("MIRLOOP", CFG.replace(policy_mirroring=MirroringPolicy.FULL))
    mirror_ws = ws._mirror_ws
    seen = []
    with contextlib.suppress(KeyError):
        for i in ws.cycles(range(5)):
            assert ws.is_open and mirror_ws.is_open and mirror_ws.generation == i
            seen.append(i)
            if i == 2 and leave == "break":
                break
            if i == 2 and leave == "raise":
                raise KeyError(i)
    assert seen == ([0, 1, 2, 3, 4] if leave == "exhaust" else [0, 1, 2])
    assert not ws.is_open and not mirror_ws.is_open
    assert mirror_ws.generation == ws.generation == len(seen)
    ws.destroy()


def test_disabled_mirroring_has_no_host_side():
    ws = dev()
    with ws:
        a = ws.zeros(3)
    assert ws._mirror_ws is None
    with pytest.raises(ValueError, match="no host mirror"):
        a.host  # noqa: B018


def test_host_only_serves_host_memory_without_a_warning():
    cfg = CFG.replace(policy_mirroring=MirroringPolicy.HOST_ONLY)
    ws = rustws.workspace("HOSTONLY", cfg, device="cuda:0")  # warnings are errors here
    assert isinstance(ws, rustws.DeviceWorkspace) and ws.fallback_reason is None
    with ws:
        a = ws.full(5, 3.0)
    assert a.device == "cpu" and a.__dlpack_device__() == (1, 0)
    assert np.shares_memory(np.asarray(a), np.from_dlpack(a))
    assert not hasattr(a, "__cuda_array_interface__")
    assert rustws.owner(a) is ws


# -- dispose -------------------------------------------------------------------------------------------
def test_dispose_returns_device_memory_and_scopes_track_device_arrays():
    ws = dev()
    with ws:
        a = ws.empty(1000)
        assert ws.stats().used_bytes > 0
        a.dispose()
        assert ws.stats().used_bytes == 0
        with pytest.raises(DisposedArrayError):
            a.to_numpy()
        with pytest.raises(DisposedArrayError):
            a.__cuda_array_interface__  # noqa: B018
        with rustws.dispose_scope() as scope:
            kept = ws.zeros(10)
            gone = ws.zeros(10)
            scope.move_to_outer(kept)
        assert gone.is_disposed and not kept.is_disposed
    assert ws.stats().used_bytes >= 80


def test_an_interface_export_keeps_memory_until_the_object_dies():
    ws = dev()
    with ws:
        a = ws.full(100, 1.0)
    interface = a.__cuda_array_interface__  # a consumer (CuPy, Numba) keeps `a` and uses the pointer
    assert interface["data"][0] == a.ptr
    a.dispose()
    assert ws.stats().used_bytes > 0, "a consumer may still use the pointer: the memory stays"
    del a
    gc.collect()
    assert ws.stats().used_bytes == 0


def test_asarray_copies_into_a_device_workspace():
    ws = dev()
    with ws:
        d = rustws.cuda.asarray(np.arange(6).reshape(2, 3), ws)
        e = rustws.cuda.asarray(d, ws)
    assert isinstance(d, DeviceArray) and d.ptr != e.ptr
    np.testing.assert_array_equal(e.to_numpy(), np.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="object"):
        rustws.cuda.asarray(np.array([None]), ws)


# -- framework allocators --------------------------------------------------------------------------
def _exports():
    lib = ctypes.CDLL(_rustws.__file__)
    malloc, free = lib.rustws_torch_malloc, lib.rustws_torch_free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return malloc, free


def test_the_exported_torch_allocator_routes_to_the_workspace():
    from rustws.torch import _route, _unroute

    malloc, free = _exports()
    ws = dev()
    held = _rustws.torch_blocks()  # PyTorch may hold blocks of earlier workspaces
    assert malloc(1000, 0, None) is None, "nothing routed: PyTorch gets NULL (its OOM path)"
    _route(ws, 0)
    try:
        p = malloc(1000, 0, None)
        assert p and p % 256 == 0
        assert _rustws.torch_blocks()[0] == held[0] + 1
        assert rustws.torch.held_by_torch()[1] >= held[1] + 1000
        assert ws.stats().allocation_count == 1
        assert malloc(1000, 1, None) is None, "another device's request is refused"
        assert malloc(-1, 0, None) is None
        q = malloc(5 << 20, 0, None)  # larger than the arena: external
        assert q and ws.stats().external_bytes >= 5 << 20
        free(q, 5 << 20, 0, None)
        free(12345, 8, 0, None)  # unknown pointers are ignored
    finally:
        _unroute(ws)
    assert malloc(8, 0, None) is None
    free(p, 1000, 0, None)  # freed after the block ended: still goes back to its workspace
    assert _rustws.torch_blocks() == held and ws.stats().used_bytes == 0


def test_torch_routes_are_per_thread():
    import threading

    from rustws.torch import _route, _unroute

    malloc, free = _exports()
    mine, theirs = dev("MINE"), dev("THEIRS")
    routed, done = threading.Event(), threading.Event()

    def other_thread():
        _route(theirs, 0)
        routed.set()
        done.wait(10)
        _unroute(theirs)

    t = threading.Thread(target=other_thread)
    t.start()
    _route(mine, 0)
    try:
        assert routed.wait(10)
        p = malloc(4096, 0, None)
        assert p and mine.stats().allocation_count == 1 and theirs.stats().allocation_count == 0
        free(p, 4096, 0, None)
    finally:
        _unroute(mine)
        done.set()
        t.join()
    assert malloc(64, 0, None) is None


def _fake_torch(calls):
    """PyTorch's pool surface as ``rustws.torch`` uses it, recording the calls."""
    import contextlib

    class MemPool:
        def __init__(self, allocator):
            self.allocator, self.id = allocator, (0, len(calls) + 1)

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        calls.append(("current thread", pool.id))
        yield

    class CUDAPluggableAllocator:
        def __init__(self, path, malloc, free):
            self.names = (malloc, free)

        def allocator(self):
            return self

    memory = types.SimpleNamespace(CUDAPluggableAllocator=CUDAPluggableAllocator)
    cuda = types.SimpleNamespace(MemPool=MemPool, use_mem_pool=use_mem_pool, memory=memory)
    c = types.SimpleNamespace(
        _cuda_beginAllocateToPool=lambda d, pid: calls.append(("begin", d, pid)),
        _cuda_endAllocateToPool=lambda d, pid: calls.append(("end", d, pid)),
        _cuda_releasePool=lambda d, pid: calls.append(("release", d, pid)),
    )
    return types.SimpleNamespace(cuda=cuda, _C=c, device=lambda kind, i: (kind, i), __version__="fake")


def test_use_workspace_serves_the_threads_pytorch_allocates_on(monkeypatch):
    # The autograd engine runs backward on a device thread of its own: with every thread routed,
    # its segment requests come from the workspace too; with the calling thread's alone, they do
    # not, and after the block nobody's do.
    import threading

    calls = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(calls))
    monkeypatch.setattr(rustws.torch, "_allocator", None)
    malloc, free = _exports()
    ws = dev("ROUTED")

    def from_another_thread(size):
        got = []
        t = threading.Thread(target=lambda: got.append(malloc(size, 0, None)))
        t.start()
        t.join()
        return got[0]

    with rustws.torch.use_workspace(ws) as pool:
        p = from_another_thread(4096)
        assert p and ws.stats().allocation_count == 1
        assert malloc(4096, 1, None) is None, "another device's request is refused"
    assert [c[0] for c in calls] == ["begin", "end", "release"] and calls[0][1:] == (0, pool.id)
    assert from_another_thread(4096) is None
    free(p, 4096, 0, None)
    with rustws.torch.use_workspace(ws, all_threads=False):
        assert from_another_thread(4096) is None
        q = malloc(4096, 0, None)
        assert q
    assert calls[-1] == ("current thread", pool.id)
    free(q, 4096, 0, None)
    assert ws.stats().used_bytes == 0
    with pytest.raises(TypeError, match="all_threads"):
        rustws.torch.use_workspace(ws, all_threads="yes").__enter__()


def test_torch_and_cupy_hooks_refuse_host_workspaces_and_say_what_is_missing(monkeypatch):
    host = rustws.workspace("H", CFG)
    with pytest.raises(TypeError, match="device workspace"):
        rustws.torch.use_workspace(host).__enter__()
    only_host = rustws.workspace("HO", CFG.replace(policy_mirroring="HOST_ONLY"), device="cuda:0")
    with pytest.raises(ValueError, match="host memory"):
        rustws.cupy.allocator(only_host)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    ws = dev()
    with pytest.raises(ImportError, match="needs PyTorch"):
        rustws.torch.use_workspace(ws).__enter__()
    with pytest.raises(ImportError, match="needs CuPy"):
        rustws.cupy.allocator(ws)


def test_the_cupy_allocator_hands_out_blocks_owned_by_cupy(monkeypatch):
    # CuPy's two classes as the allocator uses them: the pointer holds the memory, the memory
    # holds its owner.
    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id):
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    memory = types.SimpleNamespace(UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer)
    current = types.SimpleNamespace(ptr=0)
    cuda = types.SimpleNamespace(memory=memory, get_current_stream=lambda: current)
    fake = types.SimpleNamespace(cuda=cuda)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    ws = dev()
    alloc = rustws.cupy.allocator(ws)
    with ws:
        p = alloc(4096)
        assert p.ptr % 256 == 0 and p.mem.size == 4096 and p.mem.device_id == 0
        assert p.mem.owner.ptr == p.ptr and ws.stats().used_bytes >= 4096
        del p
        assert ws.stats().used_bytes == 0


def test_an_array_serves_other_threads_while_it_copies():
    # Transfers release the GIL; the array must stay usable from other threads meanwhile.
    import threading

    ws = dev(cfg=CFG.replace(initial_size="16MiB"))
    with ws:
        a = ws.zeros(1 << 20, np.float32)
    errors = []

    def copy_back():
        try:
            for _ in range(30):
                assert not a.to_numpy().any()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=copy_back)
    t.start()
    reads = 0
    while t.is_alive():
        assert a.shape == (1 << 20,) and a.ptr and a.nbytes == 4 << 20
        a.copy_from(np.zeros(1 << 20, np.float32))
        reads += 1
    t.join()
    assert not errors, errors
    assert reads > 0


def test_a_host_workspace_cannot_claim_device_arrays():
    host = rustws.workspace("PLAIN", CFG)
    with pytest.raises(ValueError, match="holds host memory"):
        host._set_device("cuda:0", True, (2, 0))
    ws = dev()
    with pytest.raises(ValueError, match="already set"):
        ws._set_device("cuda:0", True, (2, 0))


def _outcome(make, *args, **kwargs):
    try:
        return make(*args, **kwargs)
    except Exception as e:  # NumPy's refusal, which the device workspace must match
        return type(e)


def _matches(got, want, compare_values):
    if isinstance(want, type) or isinstance(got, type):
        return got is want
    host = got.to_numpy()
    if host.dtype != want.dtype or host.shape != want.shape:
        return False
    if not compare_values:
        return True
    if host.dtype.kind in "mM":
        return np.array_equal(host.view("i8"), want.view("i8"))
    if host.dtype.names:
        return host.tobytes() == want.tobytes()
    return np.array_equal(host, want, equal_nan=host.dtype.kind in "fc")


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::numpy.exceptions.ComplexWarning")
def test_device_arrays_take_numpys_arguments_with_numpys_meaning():
    # Shapes, dtypes, orders and fill values as NumPy reads them, errors included (the dtype is
    # read before the shape); the values read back are NumPy's.
    ws = dev("NUMPY-ARGS")
    shapes = [(), 0, 3, (2, 3), (0, 5), np.int64(4), np.array(3), -1, 2.0, None, (1 << 40, 1 << 40)]
    dtypes = [None, float, np.float32, ">f8", "<i2", np.dtype([("a", "i4"), ("b", "f8")]), "U3", "M8"]
    dtypes.append("nonsense")
    with ws:
        for kind in ("empty", "zeros", "ones"):
            for shape in shapes:
                for dtype in dtypes:
                    for order in ["C", "F", "A", None, "X"]:
                        got = _outcome(getattr(ws, kind), shape, dtype, order)
                        want = _outcome(getattr(np, kind), shape, dtype, order)
                        assert _matches(got, want, kind != "empty"), (kind, shape, dtype, order, got, want)
        for fill in [0, 1, 2.5, np.nan, 1 + 2j, True, "7", [1, 2]]:
            for dtype in [None, np.uint8, np.float32, "U3", "M8[D]"]:
                got, want = _outcome(ws.full, (2,), fill, dtype), _outcome(np.full, (2,), fill, dtype)
                assert _matches(got, want, True), (fill, dtype, got, want)
        base = np.arange(24.0).reshape(2, 3, 4)
        for kind in ("empty_like", "zeros_like", "ones_like", "full_like"):
            for proto in [base, np.asfortranarray(base), base.transpose(2, 0, 1), [[1, 2], [3, 4]], 3]:
                for order in ("K", "A", "C", "F", None):
                    for shape in (None, (6, 4), -1):
                        args = (proto, 7) if kind == "full_like" else (proto,)
                        got = _outcome(getattr(ws, kind), *args, order=order, shape=shape)
                        want = _outcome(getattr(np, kind), *args, order=order, shape=shape)
                        assert _matches(got, want, kind != "empty_like"), (kind, order, shape, got, want)
