"""The soak script's short form: tens of thousands of cycles with escapes on three threads, the
resident set sampled; it fails if a kept array loses its contents or memory keeps growing."""

from __future__ import annotations

import pathlib
import subprocess
import sys

SOAK = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def test_soak_short_form():
    r = subprocess.run(
        [sys.executable, str(SOAK), "--cycles", "60000", "--threads", "3", "--max-growth-mib", "48"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "60000 cycles on 3 threads" in r.stdout
