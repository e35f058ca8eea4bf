"""Where workspaces meet the operating system: ``fork()``, two processes naming the same
``temp_file_path``, and a file system too small for the arena. Each scenario runs in a fresh
interpreter, so a crash (an abort, a ``SIGBUS``) fails the test instead of the test run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

MiB = 1 << 20


def run_script(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_clean(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
@pytest.mark.parametrize("location", ["MMAP", "RAM"])
def test_a_forked_child_gets_private_memory(tmp_path, location):
    r = run_script(
        """
        import os, sys
        import numpy as np
        import rustws
        location, folder = sys.argv[1], sys.argv[2]
        cfg = rustws.WorkspaceConfiguration(
            initial_size="4MiB", policy_learning="NONE", policy_location=location,
            temp_file_path=folder if location == "MMAP" else None, policy_spill="REALLOCATE")
        ws = rustws.workspace("FORK", cfg)
        with ws:
            kept = ws.full(1000, 7.0)  # escapes: pinned in the arena
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                kept[:] = 99.0  # the child's copy
                for i in range(300):
                    with ws:
                        a = np.ones(2000) * i
                        b = ws.empty(3000)
                        b[:] = a[:3000 // 2].sum()
                del kept
            except BaseException as e:
                print("child failed:", repr(e), flush=True)
                code = 1
            os._exit(code)
        for i in range(300):
            with ws:
                a = np.ones(2000) * i
                b = ws.empty(3000)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert (kept == 7.0).all(), "the child's writes reached the parent"
        for i in range(50):
            with ws:
                c = ws.full(1000, float(i))
                assert (c == i).all() and (kept == 7.0).all()
        print("ok")
        """,
        location,
        str(tmp_path),
    )
    assert_clean(r)
    assert "ok" in r.stdout


def test_two_processes_naming_the_same_file_never_share_it(tmp_path):
    path = tmp_path / "arena.bin"
    holder = """
        import subprocess, sys
        import numpy as np
        import rustws
        path = sys.argv[1]
        cfg = rustws.WorkspaceConfiguration(
            initial_size="2MiB", policy_learning="NONE", policy_location="MMAP", temp_file_path=path)
        ws = rustws.workspace("FIRST", cfg)
        with ws:
            mine = ws.full(100_000, 7.0)
        # A second process names the same file while these arrays are live.
        second = subprocess.run([sys.executable, "-c", sys.argv[2], path], capture_output=True, text=True)
        assert second.returncode == 0, second.stderr
        assert (mine == 7.0).all(), "the second process clobbered the first one's arrays"
        with ws:
            more = ws.full(100_000, 1.0)
        assert (mine == 7.0).all() and (more == 1.0).all()
        print("ok")
        """
    second = """
import sys
import numpy as np
import rustws
cfg = rustws.WorkspaceConfiguration(
    initial_size="2MiB", policy_learning="NONE", policy_location="MMAP", temp_file_path=sys.argv[1])
ws = rustws.workspace("SECOND", cfg)
for i in range(20):
    with ws:
        a = ws.full(100_000, 3.0)
        a += np.ones(100_000)
"""
    r = run_script(holder, str(path), second)
    assert_clean(r)
    assert "ok" in r.stdout


@pytest.fixture
def small_tmpfs():
    folder = tempfile.mkdtemp(prefix="rustws-tmpfs-")
    mount = shutil.which("mount")
    if mount is None or not sys.platform.startswith("linux"):
        os.rmdir(folder)
        pytest.skip("no mount command: cannot make a small file system")
    r = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=8m", "tmpfs", folder], capture_output=True, text=True
    )
    if r.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"mounting an 8 MiB tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", folder], capture_output=True)
        os.rmdir(folder)


def test_an_arena_larger_than_its_file_system_is_out_of_memory_not_sigbus(small_tmpfs):
    r = run_script(
        """
        import sys
        import numpy as np
        import rustws
        cfg = rustws.WorkspaceConfiguration(
            initial_size="64MiB", policy_learning="NONE", policy_location="MMAP",
            temp_file_path=sys.argv[1], policy_spill="FAIL")
        try:
            ws = rustws.workspace("BIG", cfg)
            with ws:
                a = ws.zeros(8 << 20)  # 64 MiB of float64
                a[:] = 1.0
        except rustws.WorkspaceOutOfMemory as e:
            assert "64" in str(e) or "67108864" in str(e) or "bytes" in str(e), e
            print("refused:", e)
        # A workspace that fits still works on the same file system.
        small = rustws.workspace("SMALL", cfg.replace(initial_size="1MiB"))
        with small:
            b = small.full(1000, 2.0)
            assert (b == 2.0).all()
        print("ok")
        """,
        small_tmpfs,
    )
    assert_clean(r)
    assert "refused:" in r.stdout and "ok" in r.stdout
