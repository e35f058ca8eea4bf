"""The bindings' module graph: each module builds only on modules below it, so no two import each
other, and only the top (``workspace``, and the registration in ``lib``) names the Python class."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "rust" / "python" / "src"
USE = re.compile(r"crate::(?:\{([^}]*)\}|([a-z_]+)\b)")


def imports() -> dict[str, set[str]]:
    modules = {p.stem for p in SRC.glob("*.rs")} - {"lib"}
    graph: dict[str, set[str]] = {}
    for m in modules:
        text = "\n".join(line.split("//")[0] for line in (SRC / f"{m}.rs").read_text().splitlines())
        found: set[str] = set()
        for group, single in USE.findall(text):
            names = [n.strip().split("::")[0] for n in group.split(",")] if group else [single]
            found.update(n for n in names if n in modules and n != m)
        graph[m] = found
    return graph


def test_the_bindings_module_graph_has_no_cycle():
    graph = imports()
    assert len(graph) >= 15, sorted(graph)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, "import cycle: " + " -> ".join([*path, m])
        state[m] = 1
        for n in sorted(graph[m]):
            visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def test_only_the_top_names_the_python_class():
    for p in SRC.glob("*.rs"):
        if p.stem in ("workspace", "lib"):
            continue
        code = "\n".join(line.split("//")[0] for line in p.read_text().splitlines())
        assert "WorkspaceCore" not in code, f"{p.name} names WorkspaceCore: it imports upward"


def test_statistics_and_configuration_are_defined_once():
    import dataclasses

    from rustws import WorkspaceConfiguration, WorkspaceStats, _rustws

    assert tuple(f.name for f in dataclasses.fields(WorkspaceStats)) == _rustws.STATS_FIELDS
    assert tuple(f.name for f in dataclasses.fields(WorkspaceConfiguration)) == _rustws.CONFIG_FIELDS
    ws = _rustws.WorkspaceCore("FIELDS", {})
    assert len(ws._stats()) == len(_rustws.STATS_FIELDS)
