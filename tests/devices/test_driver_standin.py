"""The CUDA backend end to end, short of the hardware: the driver stand-in
(``tests/devices/driver/cuda_standin.c``) is compiled with the machine's C compiler and loaded as
``libcuda`` by a worker process (``LD_LIBRARY_PATH``), where the real CUDA and pinned-host
backends, DeviceArray exports, mirroring, errors, context restore and stream-ordered releases run
(``tests/devices/driver/cases.py``). The GPU suite (``test_cuda.py``) runs there too."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).parent / "driver"
_TREE = ast.parse((DRIVER / "cases.py").read_text())
_DEFS = [node.name for node in _TREE.body if isinstance(node, ast.FunctionDef)]
CASES = [name for name in _DEFS if name.startswith("case_")]
# Cases that change the interpreter for good (a subinterpreter): each runs in a process of its own.
SOLO_CASES = [name for name in _DEFS if name.startswith("solo_case_")]

_spec = importlib.util.spec_from_file_location("cuda_standin_build", DRIVER / "standin.py")
assert _spec is not None and _spec.loader is not None
standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standin)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return standin.build(tmp_path_factory.mktemp("cuda-driver"))


def driver_env(library: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(library), env.get("LD_LIBRARY_PATH")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(DRIVER), env.get("PYTHONPATH")) if p)
    return env


class Worker:
    """A Python process over the stand-in that runs cases on request."""

    def __init__(self, library: Path, log: Path) -> None:
        self.library, self.log = library, log
        self.proc: subprocess.Popen[str] | None = None
        self.stderr = log.open("a")

    def start(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(DRIVER / "worker.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                text=True,
                env=driver_env(self.library),
            )
        return self.proc

    def run(self, case: str, timeout: float = 120.0) -> dict[str, object]:
        proc = self.start()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(case + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            proc.wait()
            tail = self.log.read_text()[-4000:]
            return {
                "ok": False,
                "error": f"the worker died or hung in {case} (rc {proc.returncode}):\n{tail}",
            }
        reply: dict[str, object] = json.loads(line)
        return reply

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
        self.stderr.close()


@pytest.fixture(scope="module")
def worker(library: Path, tmp_path_factory: pytest.TempPathFactory):
    w = Worker(library, tmp_path_factory.mktemp("worker") / "stderr.txt")
    yield w
    w.close()


@pytest.mark.parametrize("case", CASES, ids=[c.removeprefix("case_") for c in CASES])
def test_on_the_driver_stand_in(worker: Worker, case: str) -> None:
    reply = worker.run(case)
    if not reply["ok"]:
        pytest.fail(str(reply["error"]), pytrace=False)


@pytest.mark.parametrize("case", SOLO_CASES, ids=[c.removeprefix("solo_case_") for c in SOLO_CASES])
def test_alone_on_the_driver_stand_in(library: Path, tmp_path: Path, case: str) -> None:
    w = Worker(library, tmp_path / "stderr.txt")
    try:
        reply = w.run(case)
    finally:
        w.close()
    if not reply["ok"]:
        pytest.fail(str(reply["error"]), pytrace=False)


def test_the_gpu_suite_passes_on_the_stand_in(library: Path) -> None:
    # The framework tests need the real thing (PyTorch, CuPy and JAX would launch kernels).
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not frameworks",
            str(Path(__file__).with_name("test_cuda.py")),
        ],
        capture_output=True,
        text=True,
        env=driver_env(library),
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout, done.stdout
