"""``@rustws.cycle`` under Ray: each call of a remote task or of an actor's method is one cycle of
the executing worker thread's workspace, whose temporaries are captured, and whose results reach
the driver intact."""

from __future__ import annotations

import os

import _cycle_tasks
import numpy as np
import pytest

import rustws

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'rustws[ray]')")

pytestmark = pytest.mark.timeout(240)

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def session():
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 << 20,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@ray.remote
class Stepper:
    """An actor whose method runs one cycle per call; its workspace lives as long as the actor."""

    @rustws.cycle("ACTOR")
    def step(self, i: int) -> tuple[np.ndarray, bool, int]:
        x = np.full(1 << 16, float(i), np.float64)
        t = np.tanh(x * 0.5)  # a temporary of 512 KiB from the workspace
        ws = rustws.current_workspace()
        assert ws is not None
        return t[:4].copy(), rustws.owner(t) is ws, ws.generation


def test_each_ray_task_is_one_cycle_of_its_workers_workspace(session):
    step = session.remote(_cycle_tasks.step)
    results = session.get([step.remote(i) for i in range(24)])
    assert all(name == "POOL" and captured for _, name, captured, _ in results)
    for pid in {r[0] for r in results}:
        generations = sorted(g for p, _, _, g in results if p == pid)
        assert generations == list(range(len(generations)))  # one cycle per call, in each worker
    stats = session.remote(_cycle_tasks.stats)
    rows = [row for rs in session.get([stats.remote() for _ in range(4)]) for row in rs]
    assert rows and all(r["workspace"] == "POOL" and r["spill_count"] <= 1 for r in rows)


def test_an_actors_method_calls_are_cycles_and_results_arrive_intact(session):
    actor = Stepper.remote()
    out = session.get([actor.step.remote(i) for i in range(12)])
    for i, (head, captured, generation) in enumerate(out):
        assert captured and generation == i  # the actor's calls run in order, each one cycle
        np.testing.assert_array_equal(head, np.tanh(np.full(4, float(i)) * 0.5))
