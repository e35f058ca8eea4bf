"""The ``rustws`` logger: silent unless the program configures logging (then WARNING records of
refused requests, INFO when a workspace settles, DEBUG records of what its arena does).

``logging`` is imported once the program has imported it or a record must be written, not with
rustws: a program that never imported it cannot have configured the logger, so until then no
record is made (with ``logging`` unconfigured, the logger's ``NullHandler`` drops them anyway).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# logging's levels, without importing it.
DEBUG = 10
INFO = 20
WARNING = 30

_logger: Any = None


def logger() -> Any:
    """The ``rustws`` logger, with a ``NullHandler`` (a library's logger), made when first asked.
    No lock of ours: ``logging`` makes one logger per name under its own (reset in a forked
    child), and threads that both get here add a second ``NullHandler`` at worst."""
    global _logger, enabled
    if _logger is None:
        import logging

        log = logging.getLogger("rustws")
        if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
            log.addHandler(logging.NullHandler())
        _logger = log
        # From now on the check is the logger's own (no call of ours in between: it runs each
        # time a workspace is looked up).
        enabled = log.isEnabledFor
    return _logger


def _enabled_before_made(level: int) -> bool:
    if "logging" not in sys.modules:
        return False
    return bool(logger().isEnabledFor(level))


# Whether the logger takes records of a level: never while ``logging`` was not imported; the
# logger's own ``isEnabledFor`` once the logger is made.
enabled: Callable[[int], bool] = _enabled_before_made


if "logging" in sys.modules:
    logger()
