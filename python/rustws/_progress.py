"""Progress for the command line, as tqdm behaves: a bar redrawn in place only on a terminal, a few
plain lines when the output is a pipe or a file, nothing with ``--quiet``. tqdm draws the bar when
it is installed (the optional extra ``progress``); otherwise a one-line bar of our own does.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    """``done`` of ``total`` steps, each with a label. Use as a context manager, or ``close()``."""

    def __init__(
        self, total: int, desc: str, *, quiet: bool = False, stream: TextIO | None = None, lines: int = 10
    ) -> None:
        self.total = max(total, 1)
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._bar: Any = None
        self._next_line = 0
        self._lines = max(lines, 1)
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if callable(isatty) else False
        self.mode = "quiet" if quiet else ("bar" if self.tty else "lines")
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(
                    total=self.total, desc=desc, file=self.stream, leave=True, dynamic_ncols=True
                )

    def update(self, done: int, label: str = "") -> None:
        """Moves to ``done`` steps; ``label`` says what runs now."""
        self.done = min(max(done, 0), self.total)
        if self.mode == "quiet":
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(self.done - self._bar.n)
            return
        if self.mode == "bar":
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r{self.desc} [{bar}] {self.done}/{self.total} {label:<32.32}")
            self.stream.flush()
            return
        # A pipe or a file: one line per tenth of the way (and the last), never a carriage return.
        if self.done >= self._next_line or self.done == self.total:
            pct = 100 * self.done // self.total
            suffix = f" {label}" if label else ""
            self.stream.write(f"{self.desc}: {self.done}/{self.total} ({pct}%){suffix}\n")
            self.stream.flush()
            while self._next_line <= self.done:
                self._next_line += max(self.total // self._lines, 1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()
        self.mode = "quiet"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
