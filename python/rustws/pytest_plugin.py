"""A pytest plugin that runs a test suite under capture: ``pytest -p rustws.pytest_plugin``.

Every test's call runs inside a cycle of one capturing workspace (``--rustws-cycle=test``, the
default), or the whole session is one cycle (``--rustws-cycle=session``), so every NumPy
allocation a test makes comes from the workspace. Running a library's own test suite this way,
and comparing with a plain run, shows whether code nobody wrote for rustws behaves the same under
it. ``--rustws-config=adaptive|first_loop`` picks the configuration (adaptive: the profile of
``rustws.workspace(name)`` without one). Not registered automatically: name it with ``-p``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import rustws

_WORKSPACE = "PYTEST"
_SESSION_KEY = pytest.StashKey[rustws.Workspace]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rustws", "run every test under rustws capture")
    group.addoption(
        "--rustws-cycle",
        choices=("test", "session"),
        default="test",
        help="one workspace cycle per test (default) or one for the whole session",
    )
    group.addoption(
        "--rustws-config",
        choices=("adaptive", "first_loop"),
        default="adaptive",
        help="the workspace's configuration (default: the adaptive profile)",
    )


def _workspace(config: pytest.Config) -> rustws.Workspace:
    if config.getoption("rustws_config") == "first_loop":
        return rustws.workspace(_WORKSPACE, rustws.WorkspaceConfiguration())
    return rustws.workspace(_WORKSPACE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[Any]:
    if item.config.getoption("rustws_cycle") != "test":
        yield
        return
    with _workspace(item.config):
        yield


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.getoption("rustws_cycle") == "session":
        ws = _workspace(session.config)
        ws.__enter__()
        session.config.stash[_SESSION_KEY] = ws


def pytest_sessionfinish(session: pytest.Session) -> None:
    ws = session.config.stash.get(_SESSION_KEY, None)
    if ws is not None:
        ws.__exit__(None, None, None)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    ws = rustws.get_workspace(_WORKSPACE)
    if ws is not None:
        s = ws.stats()
        terminalreporter.write_line(
            f"rustws capture ({config.getoption('rustws_cycle')} cycles): {s.cycles} cycles, "
            f"{s.allocation_count} allocations, {s.spill_count} spilled, "
            f"arena {s.capacity_bytes} bytes"
        )
