"""A one-line text progress bar for the command line (no dependency)."""

from __future__ import annotations

import sys
from typing import TextIO


def progress(label: str, done: int, total: int, stream: TextIO | None = None, width: int = 30) -> None:
    """Redraws ``[####......] done/total label`` on the current line; ends it when done."""
    out = stream if stream is not None else sys.stderr
    filled = width * done // max(total, 1)
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<28}")
    if done >= total:
        out.write("\n")
    out.flush()
