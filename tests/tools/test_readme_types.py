"""The README's Python examples pass ``mypy --strict``, taken from the README itself so that they
cannot drift from the typing the package ships (its stubs, ``py.typed`` and annotations)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# Names the examples leave to the reader, declared with the types a user's program would give them.
PRELUDE = """\
import numpy as np
from numpy.typing import NDArray

batches: list[NDArray[np.float32]]
w1: NDArray[np.float32]
w2: NDArray[np.float32]
"""


def _blocks() -> list[tuple[int, str]]:
    """Each fenced ``python`` block of the README with its first line number."""
    text = README.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    ]


BLOCKS = _blocks()


def _missing_imports(code: str) -> list[str]:
    mods = re.findall(r"^(?:from|import)\s+([A-Za-z_][\w]*)", code, re.M)
    return sorted({m for m in mods if importlib.util.find_spec(m) is None})


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One ``mypy --strict`` run over every block (a file each); its messages per file."""
    pytest.importorskip("mypy", reason="mypy is not installed (pip install 'rustws[dev]')")
    folder = tmp_path_factory.mktemp("readme")
    files = []
    for line, code in BLOCKS:
        if _missing_imports(code):
            continue
        path = folder / f"readme_line_{line}.py"
        path.write_text(PRELUDE + code)
        files.append(str(path))
    if not files:
        return {}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            # Dask's own constructors are unannotated; the examples' use of rustws is what is checked.
            "--untyped-calls-exclude=distributed",
            "--cache-dir",
            str(folder / ".mypy_cache"),
            "--no-error-summary",
            *files,
        ],
        capture_output=True,
        text=True,
        cwd=folder,
    )
    assert proc.returncode in (0, 1), proc.stderr
    report: dict[str, str] = {}
    for msg in proc.stdout.splitlines():
        report.setdefault(Path(msg.split(":", 1)[0]).name, "")
        report[Path(msg.split(":", 1)[0]).name] += msg + "\n"
    return report


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 2
    assert any("rustws.workspace(" in code for _, code in BLOCKS)


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_example_passes_mypy_strict(line: int, code: str, mypy_report: dict[str, str]) -> None:
    missing = _missing_imports(code)
    if missing:
        pytest.skip(f"README.md:{line} imports {', '.join(missing)}, not installed here")
    assert mypy_report.get(f"readme_line_{line}.py", "") == ""
