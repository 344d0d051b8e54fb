"""`scatter_trajectories` refuses a bad `src` or plan before any message, on real gloo ranks.

Two spawned processes in one gloo group with a 20 s time-out (the default is 30 min: a
refusal that came only from the time-out would fail this test, not hang it). A `src`
outside the group is refused on every rank at once; a plan that names a sample by a float
or leaves samples out is refused on the source, before it sends (so the other rank takes
no part in those calls).
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.samples import route_samples

pytestmark = pytest.mark.slow


def _samples() -> list[dict]:
    return route_samples(0, [3, 4, 5, 6], captured="all_but_last", num_layers=2, topk=2)


def _refusal(call) -> list[str] | None:
    try:
        call()
    except (TypeError, ValueError) as e:
        return [type(e).__name__, str(e)]
    except Exception as e:  # gloo's own error, recorded for the assertion
        return ["other", f"{type(e).__name__}: {e}"]
    return None


def _worker(rank: int, store_path: str, out: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    from torch_r3.distributed import scatter_trajectories

    samples = _samples()
    result: dict[str, list[str] | None] = {}
    try:
        mine = samples if rank == 0 else None
        plan = [[[0, 1]], [[2, 3]]] if rank == 0 else None
        result["src_outside"] = _refusal(lambda: scatter_trajectories(mine, plan, src=2))
        result["src_negative"] = _refusal(lambda: scatter_trajectories(mine, plan, src=-1))
        if rank == 0:
            result["float_index"] = _refusal(lambda: scatter_trajectories(samples, [[[0, 1]], [[2.7, 3]]]))
            result["left_out"] = _refusal(lambda: scatter_trajectories(samples, [[[0]], [[3]]]))
        # The group still works after the refusals: one real scatter.
        shard = scatter_trajectories(mine, plan)
        result["after"] = [str(shard.microbatches)]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_src_outside_the_group_is_refused_on_every_rank_at_once(ranks):
    for r in ranks:
        for case in ("src_outside", "src_negative"):
            kind, message = r[case]
            assert kind == "ValueError" and "src must be a rank of the group, in [0, 2)" in message, r[case]


def test_a_float_plan_index_is_refused_not_truncated(ranks):
    kind, message = ranks[0]["float_index"]
    assert kind == "TypeError" and message == "plan[1][0][0] must be an int, got float"


def test_a_plan_that_leaves_samples_out_is_refused(ranks):
    kind, message = ranks[0]["left_out"]
    assert kind == "ValueError" and message.startswith("plan: samples [1, 2] (2 of 4) go to no rank")


def test_the_group_still_scatters_after_the_refusals(ranks):
    assert [r["after"] for r in ranks] == [["[[0, 1]]"], ["[[2, 3]]"]]
