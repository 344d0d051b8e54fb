"""The hook's one copy of each microbatch's routes (issue 44): per router, in its token order, in reused memory.

`copy_for_routers` is compared with `router_indices` (the per-router view of
the routes the routers read, sequence-first), for every dtype and shape the
hook meets; `RouteBuffers` hands back the same memory step after step.
"""

from __future__ import annotations

import pytest
import torch

from torch_r3.megatron.routers import RouteBuffers, copy_for_routers
from torch_r3.megatron.slicing import router_indices


@pytest.mark.parametrize(("dtype", "k"), [(torch.uint8, 8), (torch.int16, 4), (torch.int16, 8), (torch.uint8, 3)])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_copy_gives_each_router_its_routes_in_its_token_order(dtype, k, rows):
    g = torch.Generator().manual_seed(rows)
    routes = torch.randint(0, 100, (rows, 7, 5, k), generator=g).to(dtype)
    sources = {
        "contiguous": routes,
        "a context-parallel share": routes[:, 1:6],
        "a layer subset": routes[..., [0, 2, 4], :],
        "strided experts": routes[..., ::2, :][..., :1, :].expand(rows, 7, 2, k),
    }
    for name, source in sources.items():
        for out_dtype in (dtype, torch.int64):
            b, s, j, _ = source.shape
            out = torch.full((j, s, b, k), -1, dtype=out_dtype)
            got = copy_for_routers(out, source)
            assert got.shape == (j, s * b, k) and got.data_ptr() == out.data_ptr(), name
            for layer in range(j):
                want = router_indices(source, layer).to(out_dtype)
                assert got[layer].is_contiguous() and torch.equal(got[layer], want), (name, out_dtype, layer)


def test_route_buffers_hand_back_the_same_memory_and_grow_for_a_longer_microbatch():
    buffers = RouteBuffers()
    first = [buffers.take(i, (4, 10, 1, 8), torch.uint8, torch.device("cpu")) for i in range(3)]
    assert len({t.data_ptr() for t in first}) == 3  # one buffer per microbatch of a step
    again = [buffers.take(i, (4, 9, 1, 8), torch.uint8, torch.device("cpu")) for i in range(3)]
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]  # the next step: no new memory
    wide = buffers.take(1, (4, 10, 1, 8), torch.int64, torch.device("cpu"))
    assert wide.dtype == torch.int64 and wide.shape == (4, 10, 1, 8) and wide.data_ptr() != first[1].data_ptr()
    assert buffers.take(1, (4, 10, 1, 8), torch.int64, torch.device("cpu")).data_ptr() == wide.data_ptr()
    buffers.release()
    assert buffers.take(0, (2, 2), torch.int16, torch.device("cpu")).shape == (2, 2)


@pytest.mark.parametrize(("uncaptured", "dtype"), [("live", torch.uint8), ("replay", torch.int64)])
def test_the_hook_installs_its_own_copy_per_router_in_memory_it_reuses_at_the_next_step(make_model, uncaptured, dtype):
    """One copy per microbatch, the routers' rows of it exactly `router_indices`' (the hook's only copy at
    set-up), compact where the router call widens it (live), int64 otherwise; the next step writes into
    the same memory, and refilling the caller's batch changes nothing installed."""
    from megatron.core.transformer.moe.router import TopKRouter

    from tests.megatron._models import make_batch
    from torch_r3.megatron import ReplayHook

    model = make_model()
    replays = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    batches = [make_batch(generator=torch.Generator().manual_seed(i)) for i in range(2)]
    addresses = []
    with ReplayHook(model, uncaptured=uncaptured) as hook:
        for _ in range(2):
            step = []
            with hook.step(forward_only=True):
                for batch in batches:
                    mine = {**batch, "rollout_expert_indices": batch["rollout_expert_indices"].clone()}
                    hook.begin_microbatch(mine)
                    mine["rollout_expert_indices"].fill_(0)  # the caller refills its batch
                    for layer, replay in enumerate(replays):
                        installed = replay.target_topk_idx
                        want = router_indices(batch["rollout_expert_indices"], layer).to(dtype)
                        assert installed.dtype == dtype and torch.equal(installed, want)
                    step.append([replay.target_topk_idx.data_ptr() for replay in replays])
                    hook.end_microbatch()
            addresses.append(step)
    assert addresses[0] == addresses[1]
    assert len({a for step in addresses[0] for a in step}) == len(batches) * len(replays)
