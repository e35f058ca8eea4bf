"""What one empty cycle costs: ``with ws: pass`` against ``with contextlib.nullcontext(): pass``,
side by side in one process (median of several timeit runs each), with the ratio.

Run: ``.venv/bin/python benches/scope_cost.py``. It measures the scope machinery only (entering and
leaving a cycle, making the workspace NumPy's current allocator and restoring the previous one); it
says nothing about allocation speed.
"""

from __future__ import annotations

import contextlib
import statistics
import timeit

import rustws


def median_ns(stmt: str, env: dict[str, object], number: int, repeat: int) -> float:
    runs = timeit.repeat(stmt, globals=env, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e9


def main() -> None:
    ws = rustws.workspace("SCOPE-COST")
    null = contextlib.nullcontext()
    env: dict[str, object] = {"ws": ws, "null": null, "nullcontext": contextlib.nullcontext}
    number, repeat = 200_000, 9
    rows = [
        ("with nullcontext(): pass (made once)", median_ns("with null: pass", env, number, repeat)),
        ("with ws: pass (capture on)", median_ns("with ws: pass", env, number, repeat)),
    ]
    ws.capture = False
    rows.append(("with ws: pass (capture off)", median_ns("with ws: pass", env, number, repeat)))
    ws.capture = True
    base = rows[0][1]
    for label, ns in rows:
        print(f"{label:40s} {ns:8.1f} ns  {ns / base:5.2f}x")
    ws.destroy()


if __name__ == "__main__":
    main()
