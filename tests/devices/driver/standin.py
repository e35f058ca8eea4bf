"""The CUDA driver stand-in (``cuda_standin.c``) for the Python tests: building it with the
machine's C compiler, and its switches and call log through ctypes.

The library is named ``libcuda.so`` (and ``libcuda.so.1``) in a folder of its own; a process
started with that folder first on ``LD_LIBRARY_PATH`` loads it as its CUDA driver. Nothing in the
package refers to it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("cuda_standin.c")


def build(folder: Path) -> Path:
    """Compiles the stand-in into ``folder`` (as ``libcuda.so`` and ``libcuda.so.1``); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / "libcuda.so"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the CUDA driver stand-in")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-fvisibility=hidden", "-Wl,-soname,libcuda.so"]
    done = subprocess.run([*cmd, "-o", str(lib), str(SOURCE), "-lpthread"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the CUDA driver stand-in did not compile:\n{done.stderr}")
    link = folder / "libcuda.so.1"
    if not link.exists():
        link.symlink_to(lib.name)
    return folder


class Driver:
    """The loaded stand-in (in a process whose CUDA driver it is)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so")
        self.lib = lib
        lib.standin_foreign_context.restype = ctypes.c_void_p
        lib.standin_current_context.restype = ctypes.c_void_p
        lib.standin_device_bytes.restype = ctypes.c_size_t
        lib.standin_host_bytes.restype = ctypes.c_size_t
        lib.standin_set_memory_limit.argtypes = [ctypes.c_size_t]
        lib.standin_set_free_delay_us.argtypes = [ctypes.c_long]
        lib.standin_log.restype = ctypes.c_size_t
        lib.standin_log.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]

    def reset(self) -> None:
        self.lib.standin_reset()

    def log(self) -> list[str]:
        n = self.lib.standin_log(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.lib.standin_log(buf, n + 1)
        return buf.value.decode().splitlines()

    def clear_log(self) -> None:
        self.lib.standin_clear_log()

    def set_device_count(self, n: int) -> None:
        self.lib.standin_set_device_count(n)

    def set_memory_limit(self, nbytes: int) -> None:
        self.lib.standin_set_memory_limit(nbytes)

    def set_failing_frees(self, n: int) -> None:
        self.lib.standin_set_failing_frees(n)

    def set_free_delay_us(self, us: int) -> None:
        self.lib.standin_set_free_delay_us(us)

    def set_failing_set_current(self, n: int) -> None:
        self.lib.standin_set_failing_set_current(n)

    def set_failing_copies(self, n: int) -> None:
        self.lib.standin_set_failing_copies(n)

    def set_events_pending(self, pending: bool) -> None:
        self.lib.standin_set_events_pending(int(pending))

    def complete_events(self) -> None:
        self.lib.standin_complete_events()

    def device_bytes(self) -> int:
        return int(self.lib.standin_device_bytes())

    def host_bytes(self) -> int:
        return int(self.lib.standin_host_bytes())

    def foreign_context(self) -> int:
        return int(self.lib.standin_foreign_context())

    def current_context(self) -> int:
        return int(self.lib.standin_current_context() or 0)

    def set_current(self, ctx: int) -> None:
        assert self.lib.cuCtxSetCurrent(ctx) == 0

    def primary_context(self, ordinal: int = 0) -> int:
        ctx = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal) == 0
        return int(ctx.value or 0)

    def new_stream(self, non_blocking: bool = True) -> int:
        """A stream of device 0's primary context (made current on this thread for the call);
        ``non_blocking`` makes it with ``CU_STREAM_NON_BLOCKING`` (as PyTorch's side streams are),
        else as CuPy's ``Stream()`` is, ordered by the legacy default stream."""
        previous = self.current_context()
        self.set_current(self.primary_context())
        stream = ctypes.c_void_p()
        try:
            assert self.lib.cuStreamCreate(ctypes.byref(stream), int(non_blocking)) == 0
        finally:
            self.set_current(previous)
        return int(stream.value or 0)

    def destroy_stream(self, stream: int) -> None:
        """Destroys a stream of ``new_stream``, as its owner does when done with it."""
        previous = self.current_context()
        self.set_current(self.primary_context())
        try:
            assert self.lib.cuStreamDestroy_v2(ctypes.c_void_p(stream)) == 0
        finally:
            self.set_current(previous)
