"""``@rustws.cycle``: each call one cycle of the calling thread's workspace, in threads, asyncio tasks
and process pools."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import _cycle_tasks
import numpy as np
import pytest

import rustws


def test_each_call_is_one_cycle_of_the_named_workspace():
    cfg = rustws.WorkspaceConfiguration(policy_spill="REALLOCATE")

    @rustws.cycle("DECO", cfg)
    def f(n: int) -> np.ndarray:
        ws = rustws.current_workspace()
        assert ws is not None and ws.name == "DECO" and ws.is_open
        t = np.ones(n) * 2  # a temporary from the workspace
        assert rustws.owner(t) is ws
        return t.sum(keepdims=True)  # outlives the cycle, safely

    kept = [f(1000) for _ in range(5)]
    ws = rustws.get_workspace("DECO")
    assert ws is not None and ws.config == cfg and not ws.is_open
    assert ws.generation == 5 and ws.stats().allocation_count >= 10
    assert [float(k[0]) for k in kept] == [2000.0] * 5
    assert f.__name__ == "f" and f.workspace_name == "DECO"


def test_bare_decorator_errors_and_refusals():
    @rustws.cycle
    def g() -> str | None:
        ws = rustws.current_workspace()
        return None if ws is None else ws.name

    @rustws.cycle()
    def boom() -> None:
        raise KeyError("inside")

    assert g() == "DEFAULT"
    with pytest.raises(KeyError, match="inside"):
        boom()
    ws = rustws.get_workspace("DEFAULT")
    assert ws is not None and not ws.is_open and ws.generation == 2
    with pytest.raises(TypeError, match="generator"):

        @rustws.cycle("G")
        def gen():  # pragma: no cover - refused
            yield 1

    with pytest.raises(TypeError):
        rustws.cycle(3)  # type: ignore[call-overload]


def test_each_thread_gets_its_own_workspace():
    @rustws.cycle("THREADS")
    def f(_: int) -> tuple[str, int]:
        ws = rustws.current_workspace()
        assert ws is not None
        np.tanh(np.ones(4096))
        return threading.current_thread().name, id(ws)

    with ThreadPoolExecutor(2, thread_name_prefix="deco") as pool:
        seen = list(pool.map(f, range(40)))
        rows = [r for r in rustws.thread_statistics() if r["workspace"] == "THREADS"]
    by_thread = {name: ident for name, ident in seen}
    assert len(set(by_thread.values())) == len(by_thread)  # one workspace per thread
    assert {r["thread"] for r in rows} == set(by_thread)
    assert sum(r["cycles"] for r in rows) == 40


def test_async_functions_get_a_cycle_per_call():
    @rustws.cycle("ASYNC")
    async def f(i: int) -> int:
        await asyncio.sleep(0)
        ws = rustws.current_workspace()
        assert ws is not None and ws.name == "ASYNC"
        return int(np.arange(i).sum())

    async def main() -> list[int]:
        return [await f(i) for i in range(10)]

    assert asyncio.run(main()) == [sum(range(i)) for i in range(10)]
    ws = rustws.get_workspace("ASYNC")
    assert ws is not None and ws.generation == 10 and not ws.is_open


def test_the_decorator_in_a_process_pool():
    ctx = multiprocessing.get_context("spawn")  # no fork of a threaded test process
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:
        results = list(pool.map(_cycle_tasks.step, range(24)))
        rows = [row for _ in range(4) for row in pool.submit(_cycle_tasks.stats).result()]
    assert all(name == "POOL" and captured for _, name, captured, _ in results)
    for pid in {r[0] for r in results}:
        generations = sorted(g for p, _, _, g in results if p == pid)
        assert generations == list(range(len(generations)))  # one cycle per call, in each process
    assert rows and all(r["workspace"] == "POOL" and r["spill_count"] <= 1 for r in rows)
