"""The cycle detector and the statistics printout: escaped arrays reported (with allocation sites
under ``RUSTWS_TRACE``), or raised in strict mode."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings

import pytest

import rustws
from rustws import (
    WorkspaceConfiguration,
)

MiB = 1 << 20


def cfg(**kw):
    return WorkspaceConfiguration(**kw)


def test_print_allocation_statistics():
    buf = io.StringIO()
    rustws.print_allocation_statistics(file=buf)
    assert "no workspaces" in buf.getvalue()
    ws = rustws.workspace("PRINTED", cfg(initial_size=MiB))
    with ws:
        ws.empty(10)
    buf = io.StringIO()
    rustws.print_allocation_statistics(file=buf)
    out = buf.getvalue()
    assert "PRINTED" in out and "capacity" in out and "1.3 MiB" in out


def test_cycle_detector_warns_about_escaped_arrays():
    ws = rustws.workspace("CD", cfg(initial_size=MiB, use_cycle_detector=True))
    with pytest.warns(ResourceWarning, match="'CD'.*1 array"), ws:
        kept = ws.empty(100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ws:
            t = ws.empty(100)
            del t
    del kept


def test_cycle_detector_names_allocation_sites_with_rustws_trace():
    code = (
        "import warnings, rustws\n"
        "warnings.simplefilter('error')\n"
        "ws = rustws.workspace('TR', rustws.WorkspaceConfiguration(use_cycle_detector=True))\n"
        "def make():\n"
        "    return ws.zeros(10)\n"
        "try:\n"
        "    with ws:\n"
        "        kept = make()\n"
        "        tmp = ws.empty(5); del tmp\n"
        "except ResourceWarning as w:\n"
        "    print(w)\n"
    )
    env = dict(os.environ, RUSTWS_TRACE="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "'TR'" in out and "1 array" in out
    assert "<string>:5 in make" in out, out


def test_cycle_detector_strict_raises():
    code = (
        "import rustws\n"
        "ws = rustws.workspace('S', rustws.WorkspaceConfiguration(use_cycle_detector=True))\n"
        "try:\n"
        "    with ws:\n"
        "        kept = ws.empty(100)\n"
        "except rustws.LeakedArrayError as e:\n"
        "    print('raised', e)\n"
    )
    env = dict(os.environ, RUSTWS_STRICT="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("raised") and "'S'" in out
