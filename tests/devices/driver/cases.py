"""Device workspaces over the CUDA driver stand-in: the real CUDA and pinned-host backends, the
bindings' device paths and their driver calls, short of the hardware. Each ``case_*`` function
runs in a worker process whose ``libcuda`` is the stand-in (see ``worker.py``); the stand-in's
call log shows which driver calls happened, and in what order."""

from __future__ import annotations

import ctypes
import gc
import re
import threading
import time

import numpy as np
import pytest
from standin import Driver

import rustws
from rustws import DeviceUnavailableError, WorkspaceConfiguration, WorkspaceOutOfMemory, _rustws

DRIVER = Driver()
CFG = WorkspaceConfiguration(initial_size="1MiB", policy_learning="NONE", policy_mirroring="DISABLED")


def gpu(name: str = "GPU", cfg: WorkspaceConfiguration = CFG) -> rustws.DeviceWorkspace:
    ws = rustws.workspace(name, cfg, device="cuda:0")
    assert isinstance(ws, rustws.DeviceWorkspace)
    return ws


def calls(name: str) -> list[tuple[int, int]]:
    """(address, bytes) of the successful ``name`` allocations in the log."""
    pattern = re.compile(rf"^{name} (0x[0-9a-f]+) (\d+)")
    return [(int(m[1], 16), int(m[2])) for m in map(pattern.match, DRIVER.log()) if m]


def index(log: list[str], pattern: str, start: int = 0) -> int:
    for i in range(start, len(log)):
        if re.search(pattern, log[i]):
            return i
    raise AssertionError(f"no call matching {pattern!r} after line {start}:\n" + "\n".join(log))


# DLPack, as a consumer reads it.
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", ctypes.c_uint32),
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

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
_USED = ctypes.c_char_p(b"used_dltensor")


def consume(capsule: object) -> DLManagedTensor:
    """Takes the tensor out of a legacy capsule, as a consumer does."""
    ptr = _get_pointer(capsule, b"dltensor")
    assert ptr and _set_name(capsule, _USED) == 0
    return ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor)).contents


# -- the cases ---------------------------------------------------------------------------------------
def case_the_stand_in_is_the_cuda_driver() -> None:
    assert rustws.cuda.is_available() and rustws.cuda.device_count() == 1
    assert rustws.cuda.unavailable_reason(0) is None
    ws = gpu()  # no fallback warning: warnings are errors here
    assert ws.fallback_reason is None and ws.device == "cuda:0"
    assert ws.backend_name == "cuda" and not ws.host_accessible
    regions = calls("cuMemAlloc_v2")
    assert len(regions) == 1 and regions[0][1] >= 1 << 20, "the arena is one device allocation"
    free, total = ws.device_memory_info()
    assert total == 1 << 30 and free == total - DRIVER.device_bytes()


def case_device_arrays_live_in_device_memory_and_export_a_cuda_device() -> None:
    ws = gpu()
    [(base, size)] = calls("cuMemAlloc_v2")
    with ws:
        a = ws.zeros((64, 32), np.float32)
        assert base <= a.ptr and a.ptr + a.nbytes <= base + size and a.ptr % 256 == 0
        log = DRIVER.log()
        index(log, rf"^cuMemsetD8_v2 {a.ptr:#x} {a.nbytes}$")  # zeroed by the driver
        src = np.arange(2048, dtype=np.float32).reshape(64, 32)
        a.copy_from(src)
        back = a.to_numpy()
        np.testing.assert_array_equal(back, src)
        log = DRIVER.log()
        to_device = index(log, rf"^cuMemcpyHtoD_v2 {a.ptr:#x} 8192$")
        index(log, rf"^cuMemcpyDtoH_v2 {a.ptr:#x} 8192$", to_device)
        with pytest.raises(TypeError, match="to_numpy"):
            np.asarray(a)
        assert a.__cuda_array_interface__["data"] == (a.ptr, False)
        assert a.__dlpack_device__() == (2, 0)
        managed = consume(a.__dlpack__())
        t = managed.dl_tensor
        assert (t.device.device_type, t.device.device_id) == (2, 0) and t.data == a.ptr
        managed.deleter(ctypes.pointer(managed))


def case_full_mirroring_stages_through_pinned_memory() -> None:
    ws = gpu("MIRROR", CFG.replace(policy_mirroring="FULL"))
    assert ws._mirror_ws is not None and ws._mirror_ws.backend_name == "cuda-pinned-host"
    pinned = calls("cuMemHostAlloc")
    assert pinned, "the mirror's arena is pinned by the driver"
    with ws:
        a = ws.zeros((16, 16), np.float64)
        a.host[:] = 3.0
        a.sync_to_device()
        np.testing.assert_array_equal(a.to_numpy(), np.full((16, 16), 3.0))
        h = a.host.ctypes.data
        assert any(p <= h < p + n for p, n in pinned), "the mirror lies in pinned memory"


def case_device_out_of_memory_is_a_workspace_error() -> None:
    DRIVER.set_memory_limit(4 << 20)
    ws = gpu("OOM")
    with ws, pytest.raises(WorkspaceOutOfMemory, match="out of memory") as caught:
        ws.empty(8 << 20, np.uint8)  # larger than the arena: its own cuMemAlloc, refused
    assert isinstance(caught.value, MemoryError) and "OOM" in str(caught.value)
    with ws:
        fits = ws.empty(2 << 20, np.uint8)
        assert fits.nbytes == 2 << 20


def case_a_bad_ordinal_or_no_device_is_refused_or_falls_back() -> None:
    strict = CFG.replace(helper_allow_fallback=False)
    with pytest.raises(DeviceUnavailableError, match="bad device ordinal 1"):
        rustws.workspace("BAD", strict, device="cuda:1")
    with pytest.warns(RuntimeWarning, match="ordinal 3"):
        fb = rustws.workspace("FB", CFG, device="cuda:3")
    assert fb.device == "cpu" and fb.fallback_reason and "ordinal 3" in fb.fallback_reason
    DRIVER.set_device_count(0)
    reason = rustws.cuda.unavailable_reason(0)
    assert not rustws.cuda.is_available() and reason and "no device" in reason
    with pytest.raises(DeviceUnavailableError, match="no device"):
        rustws.workspace("NONE", strict, device="cuda:0")


def case_every_driver_call_restores_the_threads_context() -> None:
    ws = gpu()
    foreign = DRIVER.foreign_context()  # as if PyTorch or CuPy had made its context current
    DRIVER.set_current(foreign)
    try:
        DRIVER.clear_log()
        with ws:
            a = ws.zeros(1000, np.float32)
            a.copy_from(np.ones(1000, np.float32))
            assert (a.to_numpy() == 1).all()
            big = ws.empty(4 << 20, np.uint8)  # outside the arena: a cuMemAlloc
            del big  # kept for the next request of its class
        ws.destroy()  # the cached block goes back to the driver: a cuMemFree
        assert DRIVER.current_context() == foreign, "the framework's context was not restored"
        log = DRIVER.log()
        index(log, r"^cuMemAlloc_v2 .* ctx=0$")
        index(log, r"^cuMemFree_v2 0x[0-9a-f]+$")
        assert not any("ctx=-1" in line or "INVALID" in line for line in log), log
    finally:
        DRIVER.set_current(0)


def case_a_context_the_driver_will_not_make_current_is_an_error() -> None:
    ws = gpu()
    DRIVER.set_failing_set_current(1)
    with ws, pytest.raises(WorkspaceOutOfMemory, match="cuCtxSetCurrent failed"):
        ws.empty(4 << 20, np.uint8)
    assert not calls("cuMemAlloc_v2")[1:], "nothing was allocated in the wrong context"
    with ws:
        assert ws.empty(4 << 20, np.uint8).nbytes == 4 << 20


def case_driver_frees_run_without_the_gil() -> None:
    ws = gpu()
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    with ws:
        big = ws.empty(4 << 20, np.uint8)
        del big  # kept for reuse: released when the workspace is destroyed
    DRIVER.set_free_delay_us(300_000)  # the driver takes 300 ms to free
    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        before = count[0]
        t0 = time.perf_counter()
        ws.destroy()
        took = time.perf_counter() - t0
        during = count[0] - before
    finally:
        stop.set()
        t.join()
    assert took >= 0.25, f"the free did not reach the driver ({took:.3f} s)"
    assert during > 10_000, f"Python threads stood still while the driver freed ({during} steps)"
    log = DRIVER.log()
    index(log, r"^cuMemFree_v2 0x[0-9a-f]+$", index(log, r"^cuMemFree_v2 0x[0-9a-f]+ begin$"))


def case_a_failing_driver_free_is_counted_not_fatal() -> None:
    ws = gpu()
    DRIVER.set_failing_frees(1)
    with ws:
        big = ws.empty(4 << 20, np.uint8)
        del big  # kept for reuse
    for _ in range(2):  # cycles that never ask for its class: it goes back to the driver
        with ws:
            pass
    assert ws._reclaim() == 1
    assert any("FAILED" in line for line in DRIVER.log())
    with ws:
        assert ws.empty(4 << 20, np.uint8).nbytes == 4 << 20


def case_a_block_used_on_another_stream_waits_for_it() -> None:
    """A stream the legacy default stream orders (CuPy's ``Stream()``): the block goes back once an
    event recorded on the legacy stream at release has passed. The consumer's stream handle is
    never named after ``__dlpack__`` returns: here the consumer destroys it before it is done."""
    ws = gpu()
    stream = DRIVER.new_stream(non_blocking=False)
    with ws:
        a = ws.empty(1000, np.float32)
        used = ws.stats().used_bytes
        DRIVER.set_events_pending(True)  # work queued on the consumer's stream is still running
        DRIVER.clear_log()
        managed = consume(a.__dlpack__(stream=stream))
        log = DRIVER.log()
        rec = index(log, r"^cuEventRecord 0x[0-9a-f]+ 0x1$")  # after the workspace's own work...
        index(log, rf"^cuStreamWaitEvent {stream:#x} ", rec)  # ...which the consumer's stream waits for
        del a
        gc.collect()
        assert ws.stats().used_bytes == used, "the consumer's tensor holds the block"
        DRIVER.destroy_stream(stream)  # the consumer's `with Stream():` ends
        DRIVER.clear_log()
        managed.deleter(ctypes.pointer(managed))  # the consumer is done, on the host
        index(DRIVER.log(), r"^cuEventRecord 0x[0-9a-f]+ 0x1$")  # on the legacy stream, which orders it
        assert ws.stats().used_bytes == used, "its stream may still use the block"
        b = ws.empty(1000, np.float32)
        assert ws.stats().used_bytes == 2 * used
        assert ws._reclaim() == 0 and ws.stats().used_bytes == 2 * used, "the event has not passed"
        DRIVER.complete_events()
        DRIVER.clear_log()
        ws._reclaim()
        assert ws.stats().used_bytes == used, "the block went back once its stream's work passed"
        log = DRIVER.log()
        index(log, r"^cuEventDestroy_v2 ", index(log, r"^cuEventQuery 0x[0-9a-f]+ complete$"))
        del b
    assert not any("DESTROYED STREAM" in line for line in DRIVER.log()), DRIVER.log()


def case_a_block_used_on_a_non_blocking_stream_waits_for_the_device() -> None:
    """A non-blocking stream (PyTorch's side streams) is not ordered by the legacy stream: the
    release waits for the whole device, and never names the stream, destroyed or not."""
    ws = gpu()
    for destroy_first in (False, True):
        stream = DRIVER.new_stream(non_blocking=True)
        with ws:
            a = ws.empty(1000, np.float32)
            managed = consume(a.__dlpack__(stream=stream))
            del a
            gc.collect()
            if destroy_first:
                DRIVER.destroy_stream(stream)
            DRIVER.clear_log()
            managed.deleter(ctypes.pointer(managed))
            log = DRIVER.log()
            index(log, r"^cuCtxSynchronize ")
            assert not any(f"{stream:#x}" in line for line in log), log
            assert ws.stats().used_bytes == 0, "the device is idle: the block is back at once"
        if not destroy_first:
            DRIVER.destroy_stream(stream)
    assert not any("DESTROYED STREAM" in line for line in DRIVER.log())


def case_a_refused_device_fill_or_copy_is_an_error() -> None:
    """``ws.zeros`` whose fill the device refuses raises instead of handing out old bytes, and a
    ``copy=True`` export whose copy fails raises instead of exporting garbage."""
    ws = gpu("FILL", WorkspaceConfiguration(policy_mirroring="DISABLED"))
    with ws:
        junk = ws.empty(1000, np.float32)
        junk.copy_from(np.full(1000, 7.0, np.float32))
        del junk
        DRIVER.set_failing_copies(1)
        with pytest.raises(DeviceUnavailableError, match=r"LAUNCH_FAILED|clear"):
            ws.zeros(1000, np.float32)
        z = ws.zeros(1000, np.float32)
        assert not z.to_numpy().any(), "a zeroed array holds old bytes"
        DRIVER.set_failing_copies(1)
        with pytest.raises(DeviceUnavailableError):
            z.__dlpack__(copy=True)
        DRIVER.set_failing_copies(0)
        del z


def case_pytorch_frees_wait_for_their_stream() -> None:
    from rustws.torch import _route, _unroute

    lib = ctypes.CDLL(_rustws.__file__)
    malloc, free = lib.rustws_torch_malloc, lib.rustws_torch_free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    ws = gpu()
    stream = DRIVER.new_stream()
    _route(ws, 0)
    try:
        p = malloc(4096, 0, None)
        assert p and ws.stats().used_bytes > 0
        DRIVER.set_events_pending(True)
        free(p, 4096, 0, stream)
        assert ws.stats().used_bytes > 0, "PyTorch's stream may still use the block"
        DRIVER.complete_events()
        ws._reclaim()
        assert ws.stats().used_bytes == 0
        q = malloc(4096, 0, None)
        free(q, 4096, 0, None)  # the legacy default stream orders itself: back at once
        assert ws.stats().used_bytes == 0
    finally:
        _unroute(ws)


def case_learned_cycles_make_no_driver_allocations() -> None:
    ws = gpu("LOOP", WorkspaceConfiguration(policy_mirroring="DISABLED"))  # learns the first cycle
    for cycle in range(4):
        if cycle == 2:
            DRIVER.clear_log()
        with ws:
            xs = [ws.full(256, float(i + cycle), np.float32) for i in range(8)]
            for i, x in enumerate(xs):
                assert (x.to_numpy() == i + cycle).all()
            del xs, x
    log = DRIVER.log()
    assert not any(line.startswith(("cuMemAlloc", "cuMemFree")) for line in log), log
    assert any(line.startswith("cuMemcpyHtoD_v2") for line in log)
    assert ws.stats().used_bytes == 0


def case_random_programs_keep_device_contents() -> None:
    # Random allocations, writes, reads and frees over several cycles: every transfer is checked
    # by the stand-in against the live device allocations, and every block keeps what was written.
    rng = np.random.default_rng(11)
    cfg = CFG.replace(initial_size="256KiB", policy_spill="REALLOCATE")
    ws = gpu("PROGRAM", cfg)
    kept: list[tuple[rustws.DeviceArray, np.ndarray]] = []
    for _cycle in range(6):
        with ws:
            live: list[tuple[rustws.DeviceArray, np.ndarray]] = []
            for _ in range(40):
                op = rng.integers(0, 4)
                if op < 2 or not live:
                    n = int(rng.integers(1, 20_000))
                    a = ws.zeros(n, np.int32) if op == 0 else ws.empty(n, np.int32)
                    data = rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
                    a.copy_from(data)
                    live.append((a, data))
                elif op == 2:
                    a, data = live.pop(int(rng.integers(0, len(live))))
                    np.testing.assert_array_equal(a.to_numpy(), data)
                else:
                    kept.append(live.pop(int(rng.integers(0, len(live)))))  # outlives the cycle
            for a, data in live:
                np.testing.assert_array_equal(a.to_numpy(), data)
            del live
        for a, data in kept:
            np.testing.assert_array_equal(a.to_numpy(), data)
        if len(kept) > 5:
            kept = kept[-5:]
    assert not any("INVALID" in line for line in DRIVER.log())
    a = data = None  # type: ignore[assignment]  # the loops' last array
    del kept, a, data
    gc.collect()
    assert ws.stats().used_bytes == 0


def case_cupy_blocks_wait_for_the_stream_they_were_made_on() -> None:
    import sys
    import types

    # CuPy's classes as the allocator uses them, and its current stream: one of the stand-in's.
    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem: UnownedMemory, offset: int) -> None:
            self.mem, self.ptr = mem, mem.ptr + offset

    # CuPy's `Stream()` is ordered by the legacy default stream; it is destroyed before the memory
    # made on it is dropped, as `with Stream():` around a block that outlives it does.
    stream = types.SimpleNamespace(ptr=DRIVER.new_stream(non_blocking=False))
    memory = types.SimpleNamespace(UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer)
    cuda = types.SimpleNamespace(memory=memory, get_current_stream=lambda: stream)
    sys.modules["cupy"] = types.SimpleNamespace(cuda=cuda)  # type: ignore[assignment]
    try:
        ws = gpu()
        alloc = rustws.cupy.allocator(ws)
        with ws:
            p = alloc(4096)
            used = ws.stats().used_bytes
            assert used >= 4096
            DRIVER.set_events_pending(True)
            DRIVER.destroy_stream(stream.ptr)
            DRIVER.clear_log()
            del p  # CuPy drops the memory; kernels queued on its stream may still run
            index(DRIVER.log(), r"^cuEventRecord 0x[0-9a-f]+ 0x1$")
            assert not any("DESTROYED STREAM" in line for line in DRIVER.log()), DRIVER.log()
            assert ws.stats().used_bytes == used
            DRIVER.complete_events()
            ws._reclaim()
            assert ws.stats().used_bytes == 0
    finally:
        del sys.modules["cupy"]


def solo_case_c_entry_points_never_release_a_gil_they_do_not_hold() -> None:
    """Once a subinterpreter exists, ``PyGILState_Check()`` says 1 on every thread, holding the GIL
    or not. The DLPack deleter and PyTorch's free, called from C on threads without the GIL
    (ctypes drops it around foreign calls), must not release a GIL they do not hold: that is a
    fatal error with no thread state. Their driver frees wait for a call that holds the GIL."""
    try:
        import _xxsubinterpreters as subinterpreters  # type: ignore[import-not-found]
    except ImportError:
        import _interpreters as subinterpreters  # type: ignore[import-not-found,no-redef]
    from rustws.torch import _route, _unroute

    interp = subinterpreters.create()
    try:
        lib = ctypes.CDLL(_rustws.__file__)  # ctypes releases the GIL around these calls
        malloc, free = lib.rustws_torch_malloc, lib.rustws_torch_free
        malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        free.restype = None
        free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        ws = gpu("SOLO", WorkspaceConfiguration(initial_size="1MiB", policy_mirroring="DISABLED"))
        with ws:
            # Blocks larger than the arena: each is a driver allocation of its own.
            capsules = [consume(ws.empty(4 << 20, np.uint8).__dlpack__()) for _ in range(3)]
            _route(ws, 0)
            try:
                torch_blocks = [malloc(4 << 20, 0, None) for _ in range(3)]
            finally:
                _unroute(ws)
            assert all(torch_blocks)

            def release_from_c() -> None:
                for managed in capsules:
                    managed.deleter(ctypes.pointer(managed))
                for p in torch_blocks:
                    free(p, 4 << 20, 0, None)

            blocks = re.findall(r"^cuMemAlloc_v2 (0x[0-9a-f]+) 4194304 ", "\n".join(DRIVER.log()), re.M)
            assert len(blocks) == 6, DRIVER.log()
            DRIVER.clear_log()
            t = threading.Thread(target=release_from_c)
            t.start()
            t.join()
            release_from_c = None  # type: ignore[assignment]
            assert not [line for line in DRIVER.log() if line.startswith("cuMemFree")], DRIVER.log()
        # Kept for reuse until a call that holds the GIL (the cycle's end, which moves the arena,
        # or destroy) releases it around the driver's frees.
        ws.destroy()
        freed = re.findall(r"^cuMemFree_v2 (0x[0-9a-f]+)$", "\n".join(DRIVER.log()), re.M)
        assert sorted(set(blocks) & set(freed)) == sorted(blocks), DRIVER.log()
    finally:
        subinterpreters.destroy(interp)
