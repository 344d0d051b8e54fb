"""`install()` in every Ray worker through `runtime_env={"worker_process_setup_hook": ...}` (issue 43 item 15).

A real local Ray cluster with two worker processes: the hook runs `torch_r3.integrations.skyrl.install()`
in each before any task, and each worker's SkyRL controller module then holds torch_r3's functions,
while the driver's stay SkyRL's own. (The worker side cannot be installed from the hook with SkyRL
0.4.0 on Ray 2.60: see `ray_setup`.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integrations.frameworks import load, requires

pytestmark = [
    requires("skyrl"),
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

ray = pytest.importorskip("ray")

from tests.integrations import ray_setup
from tests.local_ray import start_local_ray

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2


@pytest.fixture(scope="module")
def cluster():
    # Workers inherit this environment: the checkout's torch_r3 and tests/ come first on their path.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved) if p)
    try:
        start_local_ray(
            ray,
            num_cpus=WORKERS,
            object_store_memory=80 * 2**20,
            runtime_env={"worker_process_setup_hook": ray_setup.install_torch_r3},
        )
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@ray.remote(num_cpus=1)
class Worker:
    """One worker process (one CPU each, so the two actors are two processes)."""

    def report(self):
        import importlib

        import torch_r3
        import torch_r3.integrations.skyrl as r3_skyrl
        from torch_r3.integrations.skyrl import controller

        handle = ray_setup.HANDLE
        preprocess = importlib.import_module(controller.PREPROCESS)
        try:
            r3_skyrl.install(worker=False)
            second = None
        except RuntimeError as e:
            second = str(e)
        return {
            "pid": os.getpid(),
            "hook_pid": ray_setup.HOOK_PID,
            "torch_r3": torch_r3.__file__,
            "names": None if handle is None else handle.names,
            "mask_swapped": preprocess.make_router_padding_mask is r3_skyrl.make_router_padding_mask,
            "collate_module": getattr(preprocess, controller.COLLATE).__module__,
            "second_install": second,
        }


def test_the_setup_hook_installs_torch_r3_in_each_worker_process_and_not_in_the_driver(cluster):
    import torch_r3
    from torch_r3.integrations.skyrl import controller

    workers = [Worker.remote() for _ in range(WORKERS)]
    reports = ray.get([w.report.remote() for w in workers])
    pids = {r["pid"] for r in reports}
    assert len(pids) == WORKERS and os.getpid() not in pids  # two worker processes, neither the driver
    swapped = tuple(f"{controller.PREPROCESS}.{name}" for name in (controller.COLLATE, controller.MASK))
    for r in reports:
        assert r["hook_pid"] == r["pid"], r  # the hook ran in this very process, before the actor's task
        assert r["torch_r3"] == torch_r3.__file__
        assert r["names"] is not None and set(swapped) <= set(r["names"]), r
        assert r["mask_swapped"] and r["collate_module"].startswith("torch_r3."), r
        assert r["second_install"] and "already installed" in r["second_install"], r
    # The driver ran no hook: its SkyRL functions are SkyRL's own.
    (preprocess,) = load("skyrl", controller.PREPROCESS)
    import torch_r3.integrations.skyrl as r3_skyrl

    assert ray_setup.HANDLE is None
    assert preprocess.make_router_padding_mask is not r3_skyrl.make_router_padding_mask
    assert getattr(preprocess, controller.COLLATE).__module__ == controller.PREPROCESS
