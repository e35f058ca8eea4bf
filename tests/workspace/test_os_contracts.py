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


def _mounted_tmpfs(prefix: str, options: str, what: str):
    """A tmpfs mounted with ``options`` for the test, unmounted after; skipped, saying why, where
    this machine cannot mount one."""
    folder = tempfile.mkdtemp(prefix=prefix)
    mount = shutil.which("mount")
    if mount is None or not sys.platform.startswith("linux"):
        os.rmdir(folder)
        pytest.skip(f"no mount command: cannot make {what}")
    r = subprocess.run([mount, "-t", "tmpfs", "-o", options, "tmpfs", folder], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"mounting {what} is not permitted here: {r.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", folder], capture_output=True)
        os.rmdir(folder)


@pytest.fixture
def small_tmpfs():
    yield from _mounted_tmpfs("rustws-tmpfs-", "size=8m", "an 8 MiB tmpfs")


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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_fork_while_another_thread_opens_its_first_cycles_leaves_the_child_working():
    # The bindings make what they look up once (NumPy's context variable, asyncio's functions,
    # the types of a `range`'s iterators) when first used, or at import: a fork while another
    # thread is making one must not leave it half made in the child, whose first cycle would wait
    # for it forever. Each round is a fresh interpreter, where nothing is made yet, and forks
    # children while the thread takes its first steps in both forms; each child has 20 s (it
    # needs well under one).
    code = """
        import os, sys, threading, time
        import numpy as np
        import rustws
        ws = rustws.workspace("FT", rustws.WorkspaceConfiguration(initial_size="1MiB"))
        def background():
            for _ in ws.cycles(range(2)):
                a = np.ones(20000) * 2
            for _ in range(200):
                with ws:
                    a = np.ones(20000) * 2
        t = threading.Thread(target=background)
        t.start()
        children = []
        while t.is_alive() and len(children) < 20 or not children:
            pid = os.fork()
            if pid == 0:
                with ws:
                    x = np.ones(50000) * 2
                for _ in ws.cycles(range(3)):
                    y = np.full(1000, 3.0) + x[:1000]
                os._exit(0 if (y == 5).all() else 3)
            children.append(pid)
        deadline = time.monotonic() + 20
        for pid in children:
            while not (done := os.waitpid(pid, os.WNOHANG))[0]:
                if time.monotonic() > deadline:
                    for p in children:
                        try:
                            os.kill(p, 9)
                        except ProcessLookupError:
                            pass
                    print("a child hung")
                    sys.exit(1)
                time.sleep(0.005)
            assert os.waitstatus_to_exitcode(done[1]) == 0, done
        t.join()
        print("ok")
        """
    for _ in range(6):
        r = run_script(code, timeout=60)
        assert_clean(r)
        assert "ok" in r.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_sees_its_parents_memory_as_it_was_at_fork(tmp_path):
    """The parent writes right after ``fork()`` returns; the child must see the contents of the
    moment of the fork, never those later writes (its MMAP regions are snapshots taken before the
    fork, not copies made while the parent runs on)."""
    r = run_script(
        """
        import os, sys
        import numpy as np
        import rustws
        cfg = rustws.WorkspaceConfiguration(
            initial_size="160MiB", policy_learning="NONE", policy_location="MMAP", temp_file_path=sys.argv[1])
        ws = rustws.workspace("SNAP", cfg)
        with ws:
            a = ws.full(16 << 20, 1.0)  # 128 MiB, pinned past the cycle
        for trial in range(3):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                os.read(r, 1)  # wait until the parent has written
                bad = int((a != float(trial + 1)).sum())
                os._exit(0 if bad == 0 else 1)
            os.close(r)
            a[:] = -1.0  # right after fork() returned: must not reach the child
            os.write(w, b"x")
            os.close(w)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, f"trial {trial}: the child saw later writes"
            a[:] = float(trial + 2)
        print("ok")
        """,
        str(tmp_path),
    )
    assert_clean(r)
    assert "ok" in r.stdout


def test_an_existing_file_named_by_temp_file_path_is_never_written(tmp_path):
    """A user's file at ``temp_file_path`` is left exactly as it was (regions are mapped beside it);
    a file the workspace creates is removed with its region, and only by the process that made
    it (a forked child that ends does not remove its parent's file)."""
    r = run_script(
        """
        import os, sys
        import numpy as np
        import rustws
        folder = sys.argv[1]
        users = os.path.join(folder, "weights.npy")
        np.save(users, np.arange(10.0))
        before = open(users, "rb").read()
        cfg = rustws.WorkspaceConfiguration(
            initial_size="2MiB", policy_learning="NONE", policy_location="MMAP", temp_file_path=users,
            policy_spill="REALLOCATE")
        ws = rustws.workspace("EXISTING", cfg)
        for i in range(5):
            with ws:
                a = ws.full(100_000, float(i))
                b = ws.empty(1 << 20)  # spills: the arena grows into a new region
        ws.destroy()
        del a, b
        assert open(users, "rb").read() == before, "the user's file was changed"
        assert (np.load(users) == np.arange(10.0)).all()
        assert sorted(os.listdir(folder)) == ["weights.npy"], os.listdir(folder)

        made = os.path.join(folder, "arena.bin")
        ws = rustws.workspace("CREATED", cfg.replace(temp_file_path=made))
        with ws:
            kept = ws.full(1000, 5.0)
        assert os.path.exists(made), "the named file is the first region's"
        pid = os.fork()
        if pid == 0:
            ws.destroy()
            del kept
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.exists(made), "a forked child removed its parent's file"
        ws.destroy()
        assert os.path.exists(made), "removed while an array lives in its region"
        del kept
        import gc; gc.collect()
        assert not os.path.exists(made), "the file the workspace created was left behind"
        assert sorted(os.listdir(folder)) == ["weights.npy"], os.listdir(folder)
        print("ok")
        """,
        str(tmp_path),
    )
    assert_clean(r)
    assert "ok" in r.stdout


# A madvise that refuses MADV_POPULATE_WRITE (23), as kernels before 5.14 and gVisor do.
_NO_POPULATE_WRITE_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>

static int refused;

int madvise(void *addr, size_t len, int advice) {
    static int (*real)(void *, size_t, int);
    if (advice == 23) {
        __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
        errno = EINVAL;
        return -1;
    }
    if (!real) real = (int (*)(void *, size_t, int))dlsym(RTLD_NEXT, "madvise");
    return real(addr, len, advice);
}

int rustws_test_populate_write_refusals(void) { return __atomic_load_n(&refused, __ATOMIC_RELAXED); }
"""


@pytest.fixture(scope="module")
def no_populate_write(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the madvise shim")
    folder = tmp_path_factory.mktemp("shim")
    src, lib = folder / "shim.c", folder / "libnopopulate.so"
    src.write_text(_NO_POPULATE_WRITE_C)
    done = subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"], capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    return lib


@pytest.mark.parametrize("profile", ["adaptive", "first_loop", "over_time"])
def test_prefaulting_without_populate_write_never_changes_a_live_array(no_populate_write, profile):
    """With ``MADV_POPULATE_WRITE`` refused, pre-faulting touches every page of the learned part
    of the arena when a cycle opens. Arrays made between cycles (``ws.empty`` outside a ``with``,
    ``borrow()``) and arrays pinned by earlier cycles live there: not a byte of them, nor of their
    block headers (a header that loses its magic turns a live block into free memory) may change."""
    env = dict(os.environ, LD_PRELOAD=str(no_populate_write))
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import ctypes, sys
                import numpy as np
                import rustws
                profile = sys.argv[1]
                cfg = {
                    "adaptive": rustws.WorkspaceConfiguration.adaptive(),
                    "first_loop": rustws.WorkspaceConfiguration(policy_spill="REALLOCATE"),
                    "over_time": rustws.WorkspaceConfiguration(
                        policy_learning="OVER_TIME", cycles_before_initialization=2,
                        policy_spill="REALLOCATE"),
                }[profile]
                ws = rustws.workspace("NOPOP", cfg)
                live = []
                for cycle in range(6):
                    with ws:
                        temps = [np.full(300_000, float(i)) for i in range(4)]  # captured, 2.4 MB each
                        live.append((ws.full(50_000, 1000.0 + cycle), 1000.0 + cycle))
                        del temps
                    for k in range(6):  # made between cycles, in the arena
                        a = ws.empty(3000 + 512 * k)
                        a[:] = 7.0 * cycle + k
                        live.append((a, 7.0 * cycle + k))
                    with ws.borrow():
                        b = np.full(20_000, -3.0 - cycle)
                        live.append((b, -3.0 - cycle))
                    for arr, value in live:
                        assert (arr == value).all(), f"cycle {cycle}: a live array changed"
                refused = ctypes.CDLL(None).rustws_test_populate_write_refusals()
                assert refused > 0, "the shim was not used: the fallback never ran"
                live.clear()  # every header intact: the frees find their blocks
                del a, b, arr
                with ws:
                    c = ws.full(1000, 1.0)  # above the adaptive profile's helper_min_size
                s = ws.stats()
                assert s.used_bytes == 1000 * 8 and s.pinned_bytes == 1000 * 8, s
                print("ok", refused)
                """
            ),
            profile,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert_clean(r)
    assert "ok" in r.stdout


def _mmap_config(path):
    import rustws

    return rustws.WorkspaceConfiguration(
        initial_size="1MiB", policy_learning="NONE", policy_location="MMAP", temp_file_path=path
    )


def _unusable_paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    sock_path = tmp_path / "sock"
    import socket

    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    return sock, {
        "/dev/null": "/dev/null",
        "a character device folder's file": "/dev/null/x",
        "a NUL byte": str(tmp_path / "a\0b"),
        "a FIFO": str(fifo),
        "a socket": str(sock_path),
        "a symlink loop": str(loop),
        "a file under a symlink loop": str(loop / "x"),
        "a missing folder": str(tmp_path / "missing" / "x"),
        "a file system that makes no files": "/proc/rustws-arena.bin",
        "/proc itself": "/proc",
    }


def test_unusable_mmap_paths_are_value_errors_naming_temp_file_path(tmp_path):
    sock, paths = _unusable_paths(tmp_path)
    try:
        for what, path in paths.items():
            with pytest.raises(ValueError, match="temp_file_path") as e:
                _mmap_config(path)
            assert not isinstance(e.value, MemoryError), what
    finally:
        sock.close()


def test_a_path_that_became_unusable_is_refused_when_the_workspace_is_made(tmp_path):
    import rustws

    folder = tmp_path / "gone"
    folder.mkdir()
    cfg = _mmap_config(str(folder / "arena.bin"))
    folder.rmdir()
    with pytest.raises(ValueError, match="temp_file_path"):
        rustws.workspace("GONE", cfg)
    cfg = _mmap_config(str(tmp_path / "arena.bin"))
    os.mkfifo(tmp_path / "arena.bin")  # what the path names now cannot hold a mapping
    with pytest.raises(ValueError, match="temp_file_path"):
        rustws.workspace("FIFO", cfg)


def test_a_folder_without_permission_is_a_value_error(tmp_path):
    """Permission bits are not the answer for root, so the check asks the file system; here as an
    unprivileged user (a child that drops root, or a folder this user may not write)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(folder, 0o555)
    try:
        r = run_script(
            """
            import os, sys
            import rustws
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)  # nobody: the folder is root's, read-only to others
            for path in (sys.argv[1], os.path.join(sys.argv[1], "arena.bin")):
                try:
                    rustws.WorkspaceConfiguration(
                        initial_size="1MiB", policy_learning="NONE", policy_location="MMAP",
                        temp_file_path=path)
                except ValueError as e:
                    assert "temp_file_path" in str(e) and "ermission" in str(e), e
                else:
                    raise AssertionError(f"{path} was accepted")
            print("ok")
            """,
            str(folder),
        )
    finally:
        os.chmod(folder, 0o755)
    assert_clean(r)
    assert "ok" in r.stdout


@pytest.fixture
def read_only_mount():
    yield from _mounted_tmpfs("rustws-ro-", "ro,size=1m", "a read-only tmpfs")


def test_a_read_only_file_system_is_a_value_error(read_only_mount):
    for path in (read_only_mount, os.path.join(read_only_mount, "arena.bin")):
        with pytest.raises(ValueError, match=r"temp_file_path.*[Rr]ead-only"):
            _mmap_config(path)
