"""The command line: progress as tqdm behaves (a bar only on a terminal, plain lines in pipes, nothing
with --quiet), ratios worded so they cannot be misread, and the demo's quick run."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from rustws._bench import ratio_text
from rustws._progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO, quiet: bool = False) -> str:
    with Progress(50, "bench", quiet=quiet, stream=stream) as bar:
        for i in range(51):
            bar.update(i, f"W1 run {i}")
    return stream.getvalue()


def test_a_pipe_gets_a_few_plain_lines():
    out = _run(io.StringIO())
    lines = out.splitlines()
    assert "\r" not in out and 2 <= len(lines) <= 12
    assert lines[-1] == "bench: 50/50 (100%) W1 run 50"


def test_a_terminal_gets_a_bar_redrawn_in_place(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # without tqdm: the bar of our own, every step
    out = _run(Terminal())
    assert out.count("\r") >= 50 and out.endswith("\n")
    assert "50/50" in out


def test_a_terminal_gets_tqdms_bar_where_tqdm_is_installed():
    pytest.importorskip("tqdm", reason="tqdm is not installed (pip install 'rustws[progress]')")
    out = _run(Terminal())
    # tqdm redraws at most every tenth of a second: the last draw, at least, is in place.
    assert out.count("\r") >= 2 and out.endswith("\n")
    assert "50/50" in out.rsplit("\r", 1)[-1] and "W1 run 50" in out


def test_quiet_prints_nothing():
    assert _run(Terminal(), quiet=True) == "" and _run(io.StringIO(), quiet=True) == ""


@pytest.mark.parametrize(
    ("a", "b", "words"),
    [
        (1.2, 1.0, "rustws / best peer (tcmalloc) = 1.20 (rustws slower)"),
        (0.83, 1.0, "rustws / best peer (tcmalloc) = 0.83 (rustws faster)"),
        (1.001, 1.0, "rustws / best peer (tcmalloc) = 1.00 (the same)"),
    ],
)
def test_ratios_say_which_way_they_go(a, b, words):
    assert ratio_text("rustws", a, "best peer (tcmalloc)", b) == words


@pytest.mark.timeout(180)
def test_the_quick_demo_compares_both_runs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rustws",
            "demo",
            "--quick",
            "--quiet",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "losses identical in all 6 steps: True" in out
    assert "rustws / NumPy time per step = " in out and "rustws / NumPy peak RSS = " in out
    assert "what it costs:" in out
    for name in ("ACTIVATIONS", "ACTIVATION_GRAD", "LAYER_WORKING_MEM"):
        assert name in out
    assert 'initial_size="' in out
    assert proc.stderr == ""  # --quiet: no progress


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "--repeats", "0"], "--repeats (runs per variant) must be at least 1, got 0"),
        (["bench", "--repeats", "-3"], "must be at least 1, got -3"),
        (["bench", "--workloads", "W99"], "unknown workload(s) W99"),
        (["demo", "--steps", "1"], "--steps (batches per epoch) must be at least 2"),
    ],
)
def test_bad_arguments_are_a_usage_error_before_anything_runs(argv, says, capsys):
    from rustws.__main__ import main

    assert main([*argv, "--quick", "-q"]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and captured.out == ""
