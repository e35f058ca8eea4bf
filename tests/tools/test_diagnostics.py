"""What rustws tells: its logger (silent by default; INFO when a workspace settles, DEBUG records of
its arena), escape reports seen under default warning filters at the user's line, ``owner()``
through buffer exporters, and ``python -m rustws info``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rustws
from rustws import _rustws
from rustws._workspace import Workspace

DETECT = rustws.WorkspaceConfiguration(use_cycle_detector=True, policy_spill="REALLOCATE")


def test_the_logger_is_silent_unless_configured():
    handlers = logging.getLogger("rustws").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


LATE_LOGGING = textwrap.dedent(
    """
    import sys
    import numpy as np
    import rustws

    assert "logging" not in sys.modules, "imported with rustws"
    for _ in range(3):
        with rustws.workspace("QUIET"):
            np.tanh(np.ones(4096))
    assert "logging" not in sys.modules, "imported by cycles nobody logs"
    import logging

    logging.basicConfig(level=logging.DEBUG, format="%(name)s %(levelname)s %(message)s")
    for _ in range(3):
        with rustws.workspace("LOUD"):
            np.tanh(np.ones(4096))
    """
)


def test_logging_is_imported_only_by_programs_that_use_it():
    """A program that never imports ``logging`` does not get it from rustws (its modules take
    memory that plain NumPy does not); one that configures it later gets the records."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHONDEVMODE")}
    proc = subprocess.run([sys.executable, "-c", LATE_LOGGING], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "rustws INFO workspace 'LOUD'" in proc.stderr, proc.stderr
    assert "rustws DEBUG workspace 'LOUD'" in proc.stderr, proc.stderr
    assert "QUIET" not in proc.stderr, proc.stderr


LAZY_PARTS = textwrap.dedent(
    """
    import sys
    import numpy as np
    import rustws

    lazy = ("rustws.memory", "rustws._pipeline", "rustws._layers", "queue", "sysconfig")
    with rustws.workspace("PLAIN"):
        np.tanh(np.ones(4096))
    assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]
    assert {"memory", "AsyncPrefetch", "LayerWorkspaceMgr", "gc_window"} <= set(dir(rustws))
    from rustws import gc_window

    assert gc_window.__module__ == "rustws._pipeline" and "rustws.memory" not in sys.modules
    assert rustws.memory.recommend and rustws.LayerWorkspaceMgr.__name__ == "LayerWorkspaceMgr"
    assert rustws.memory is sys.modules["rustws.memory"]
    try:
        rustws.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name was found")
    namespace = {}
    exec("from rustws import *", namespace)
    assert set(rustws.__all__) <= set(namespace)
    """
)


def test_parts_a_capturing_loop_never_uses_are_imported_when_first_named():
    """``import rustws`` leaves out the memory tools, the pipeline and the layer manager (and the
    standard modules they need) until a program names them; every public name still resolves."""
    proc = subprocess.run([sys.executable, "-c", LAZY_PARTS], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # An environment that asks for a snapshot at each refusal gets it set up at import.
    env = dict(os.environ, RUSTWS_OOM_SNAPSHOT="/nonexistent/snap.pickle")
    check = (
        "import sys, rustws; from rustws import _rustws; "
        "print('rustws.memory' in sys.modules, _rustws.recording_stacks())"
    )
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
    assert proc.stdout.split() == ["True", "True"], proc.stderr


def _cycles(ws_name: str, sizes: list[int]) -> None:
    for n in sizes:
        with rustws.workspace(ws_name):
            a = np.ones(n) * 2
            np.tanh(a)
            del a


def test_info_when_a_workspace_settles_and_debug_records_of_its_arena(caplog):
    with caplog.at_level(logging.DEBUG, logger="rustws"):
        _cycles("OBSERVED", [1 << 16] * 3 + [1 << 20] + [1 << 16] * 12)
    records = [r for r in caplog.records if r.name == "rustws"]
    text = [r.getMessage() for r in records]
    settled = [m for r, m in zip(records, text, strict=True) if r.levelno == logging.INFO]
    assert len(settled) == 1 and "'OBSERVED' settled after" in settled[0]  # once
    debug = [m for r, m in zip(records, text, strict=True) if r.levelno == logging.DEBUG]
    assert any("mapped an arena" in m for m in debug)
    assert any("grew" in m for m in debug)  # the larger cycle
    assert any("spilled" in m for m in debug)
    assert any("shrank" in m for m in debug)  # once the outlier left the window
    assert any("page faults while opening cycle" in m for m in debug)  # the pre-fault


def test_the_loop_form_logs_its_cycles_as_with_blocks_do(caplog):
    sizes = [1 << 16] * 3 + [1 << 20] + [1 << 16] * 12

    def messages(name):
        return [
            r.getMessage().replace(name, "W")
            for r in caplog.records
            if r.name == "rustws" and name in r.getMessage()
        ]

    with caplog.at_level(logging.DEBUG, logger="rustws"):
        _cycles("WITH_FORM", sizes)
        ws = rustws.workspace("LOOP_FORM")
        for n in ws.cycles(sizes):
            a = np.ones(n) * 2
            np.tanh(a)
            del a
        with ws, ws:  # a cycle and a level nested in it: one more cycle, logged once
            np.ones(1 << 16) * 2
    loop = messages("LOOP_FORM")
    assert sum("settled after" in m for m in loop) == 1
    assert any("mapped an arena" in m for m in loop) and any("grew" in m for m in loop)
    # The same cycle records as the `with` form (its pre-fault records are counted on entry).
    records = [m for m in loop if "page faults while opening" not in m]
    expected = [m for m in messages("WITH_FORM") if "page faults while opening" not in m]
    assert records[: len(expected)] == expected
    assert ws.stats().cycles == len(sizes) + 1


def test_unobserved_cycles_run_the_bindings_alone(caplog):
    ws = rustws.workspace("QUIET")
    assert type(ws) is Workspace  # no Python between `with` and the bindings
    assert type(ws).__exit__ is _rustws.WorkspaceCore.__exit__
    with caplog.at_level(logging.INFO, logger="rustws"):
        ws = rustws.workspace("QUIET")
        assert type(ws) is not Workspace and isinstance(ws, Workspace)
        assert type(ws).__name__ == "Workspace"
    _cycles("QUIET", [1024])  # the logger is quiet again: the workspace drops the observer
    assert type(ws) is Workspace and not caplog.records


def _escape_line() -> int:
    return sys._getframe(1).f_lineno + 1


def test_escape_reports_point_at_the_users_with():
    ws = rustws.workspace("ESC", DETECT)
    kept = []
    with pytest.warns(rustws.EscapedArrayWarning) as rec:
        line = _escape_line()
        with ws:
            kept.append(np.ones(100) * 2)
    assert issubclass(rustws.EscapedArrayWarning, ResourceWarning)
    assert rec[0].filename == __file__ and rec[0].lineno == line
    mgr = rustws.LayerWorkspaceMgr.builder().default_workspace("LAYER", DETECT).build()
    with pytest.warns(rustws.EscapedArrayWarning) as rec:
        line = _escape_line()
        with mgr.notify_scope_entered(rustws.ArrayType.ACTIVATIONS):  # through contextlib
            kept.append(np.ones(100) * 2)
    assert rec[0].filename == __file__ and rec[0].lineno == line

    @rustws.cycle("DECO", DETECT)
    def step() -> np.ndarray:
        return np.ones(100) * 2

    with pytest.warns(rustws.EscapedArrayWarning) as rec:
        line = _escape_line()
        kept.append(step())
    assert rec[0].filename == __file__ and rec[0].lineno == line


SCRIPT = textwrap.dedent(
    """\
    import numpy as np
    import rustws

    cfg = rustws.WorkspaceConfiguration(use_cycle_detector=True)
    keep = []
    for _ in range(2):
        with rustws.workspace("LOOP", cfg):
            keep.append(np.ones(1000) * 2)
    """
)


@pytest.mark.parametrize("options", [[], ["-W", "ignore::ResourceWarning"], ["-W", "error"]])
def test_escape_reports_are_seen_under_default_filters(tmp_path, options):
    script = tmp_path / "user_loop.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHONDEVMODE")}
    proc = subprocess.run([sys.executable, *options, str(script)], capture_output=True, text=True, env=env)
    if not options:  # Python's defaults ignore ResourceWarning; this one is shown, at the user's line
        assert proc.returncode == 0, proc.stderr
        assert f"{script}:7: EscapedArrayWarning" in proc.stderr and "outlived cycle" in proc.stderr
    elif options[1] == "error":  # the program's own filters still decide
        assert proc.returncode != 0 and "EscapedArrayWarning" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stderr == ""


def test_owner_follows_buffer_exporters():
    ws = rustws.workspace("OWN")
    with ws:
        a = np.arange(1024.0)  # above the adaptive profile's helper_min_size
        view = memoryview(a)
        assert rustws.owner(view) is ws
        assert rustws.owner(memoryview(view)) is ws  # a memoryview of a memoryview
        assert rustws.owner(np.frombuffer(view)) is ws  # an ndarray over the exporter
        assert rustws.owner(np.asarray(view)[2:]) is ws
        with rustws.scope_out_of_workspaces():
            plain = np.arange(1024.0)
        assert rustws.owner(memoryview(plain)) is None
        assert rustws.owner(memoryview(b"bytes")) is None
        assert rustws.owner(np.frombuffer(b"abcdefgh")) is None
        assert rustws.owner([1, 2]) is None


class _Interface:
    """A consumer that shows memory only through ``__array_interface__`` (as frameworks do)."""

    def __init__(self, a, offset=0):
        self.__array_interface__ = {
            "shape": (a.size - offset,),
            "typestr": a.dtype.str,
            "data": (a.ctypes.data + offset * a.itemsize, False),
            "version": 3,
        }


class _Capsule:
    """A DLPack producer that is not an ndarray (a tensor of another framework)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_owner_finds_consumers_by_the_address_of_their_data():
    """Objects that hold workspace memory without a reference Python can follow to the array (a
    tensor made by ``torch.from_numpy``, an Arrow buffer) are found by address: in the arena,
    outside it (kept results, blocks of their own) and in huge mappings, at any offset."""
    import ctypes

    ws = rustws.workspace("ADDR")
    other = rustws.workspace("ADDR2")
    kept = []
    for k in range(4):
        with ws:
            a = np.ones(4096) * k  # in the arena from the second cycle on
            kept.append(a[::2].copy())  # kept results: outside the arena once it is full
    with ws:
        a = np.ones(4096)
        big = ws.empty(1 << 27, np.uint8)  # a huge request: a mapping of its own
        small = ws.empty(10)  # below helper_min_size: not workspace memory
        targets = {"arena": a, "kept": kept[-1], "huge": big}
        for where, arr in targets.items():
            n = arr.size
            by_ctypes = (ctypes.c_char * arr.nbytes).from_address(arr.ctypes.data)
            assert rustws.owner(by_ctypes) is ws, where  # the buffer protocol
            assert rustws.owner(_Interface(arr)) is ws, where
            assert rustws.owner(_Interface(arr, n // 2)) is ws, where  # inside the block
            assert rustws.owner(_Capsule(arr)) is ws, where  # DLPack
            assert rustws.owner(np.from_dlpack(_Capsule(arr))) is ws, where
            assert rustws.owner(np.ctypeslib.as_array(by_ctypes)) is ws, where
        assert rustws.owner(_Interface(small)) is None
        with rustws.scope_out_of_workspaces():
            plain = np.ones(4096)
        assert rustws.owner(_Interface(plain)) is None
        assert rustws.owner((ctypes.c_char * 8).from_address(plain.ctypes.data)) is None
        assert not other._holds(a.ctypes.data)  # the lookup found the right one of several


def test_info_lists_libraries_and_rustws_variables(monkeypatch, capsys):
    from rustws.__main__ import main

    monkeypatch.setenv("RUSTWS_STRICT", "1")
    monkeypatch.setenv("RUSTWS_NOT_A_SWITCH", "x")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"numpy {np.__version__}" in out
    assert "RUSTWS_STRICT=1" in out and "RUSTWS_NOT_A_SWITCH=x  (not read by this version)" in out
    for lib in ("torch", "cupy", "jax", "dask"):
        assert f"{lib} " in out.split("libraries:")[1]
