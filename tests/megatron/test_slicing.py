"""The slicing helpers against plain, loop-based references on fabricated shapes."""

from __future__ import annotations

import types

import pytest
import torch

from torch_r3.megatron import (
    RankSlice,
    context_parallel_positions,
    moe_layer_pattern,
    packed_positions,
    route_layer_index,
    router_indices,
    slice_for_rank,
    stage_layer_range,
)


def _reference_rank_view(routes, cp_size, cp_rank, tp_size, tp_rank, sp):
    """What a router on (cp_rank, tp_rank) sees, built position by position: [S*B, L, K]."""
    b, t = routes.shape[:2]
    chunk = t // (2 * cp_size)
    cp_local = [p for c in (cp_rank, 2 * cp_size - 1 - cp_rank) for p in range(c * chunk, (c + 1) * chunk)]
    if sp and tp_size > 1:
        share = len(cp_local) // tp_size
        cp_local = cp_local[tp_rank * share : (tp_rank + 1) * share]
    return torch.stack([routes[bi, p] for p in cp_local for bi in range(b)])


@pytest.mark.parametrize(
    "cp_size, tp_size, sp", [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, True), (4, 2, True), (2, 2, False)]
)
def test_every_rank_sees_its_cp_chunks_and_sp_share(cp_size, tp_size, sp):
    b, t, layers, k = 3, 16, 2, 2
    routes = torch.arange(b * t * layers * k, dtype=torch.int32).reshape(b, t, layers, k)
    mask = torch.rand(b, t) > 0.5
    seen = []
    for cp_rank in range(cp_size):
        for tp_rank in range(tp_size):
            rank = RankSlice(cp_size, cp_rank, tp_size, tp_rank, sp)
            local, local_mask = slice_for_rank(routes, mask, rank, model_scatters_mask=False)
            ref = _reference_rank_view(routes, cp_size, cp_rank, tp_size, tp_rank, sp)
            for layer in range(layers):
                assert torch.equal(router_indices(local, layer), ref[:, layer])
            ref_mask = _reference_rank_view(mask[..., None, None], cp_size, cp_rank, tp_size, tp_rank, sp)
            assert torch.equal(local_mask.transpose(0, 1).reshape(-1), ref_mask.reshape(-1))
            seen.append(ref[:, 0, 0])
    # Across all ranks every token is routed exactly once (per TP group with SP).
    covered = torch.cat(seen).sort().values
    copies = 1 if (sp and tp_size > 1) else tp_size
    assert torch.equal(covered, routes[:, :, 0, 0].reshape(-1).repeat_interleave(copies).sort().values)


def test_first_stage_mask_is_left_for_the_model_to_scatter():
    routes = torch.zeros(2, 8, 1, 2, dtype=torch.uint8)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    local, local_mask = slice_for_rank(routes, mask, RankSlice(tp_size=2, tp_rank=1, sequence_parallel=True))
    assert local.shape == (2, 4, 1, 2) and local_mask.shape == (2, 8)


def test_context_parallel_positions_match_megatrons_chunk_pairs():
    assert context_parallel_positions(12, 3, 0).tolist() == [0, 1, 10, 11]
    assert context_parallel_positions(12, 3, 2).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="multiple of 2 \\* context_parallel_size = 4"):
        context_parallel_positions(10, 2, 0)


def test_packed_layout_splits_each_sequence_on_its_own():
    cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    lengths = [4, 8, 4]
    for rank in range(2):
        want, start = [], 0
        for n in lengths:
            want += [start + p for p in context_parallel_positions(n, 2, rank).tolist()]
            start += n
        assert packed_positions(cu, 2, rank).tolist() == want
    with pytest.raises(ValueError, match="sequence 1 has 6 tokens"):
        packed_positions(torch.tensor([0, 4, 10]), 2, 0)
    with pytest.raises(ValueError, match="non-decreasing values starting at 0"):
        packed_positions(torch.tensor([1, 4]), 1, 0)
    with pytest.raises(TypeError, match="cu_seqlens: expected a torch.Tensor"):
        packed_positions([0, 4], 1, 0)


def test_packed_slice_with_sequence_parallel_keeps_token_order():
    routes = torch.arange(16 * 2).reshape(16, 1, 2)
    mask = torch.zeros(16, dtype=torch.bool)
    cu = torch.tensor([0, 8, 16])
    local, local_mask = slice_for_rank(
        routes, mask, RankSlice(2, 1, 2, 1, True), cu_seqlens=cu, model_scatters_mask=False
    )
    tokens = [p for p in packed_positions(cu, 2, 1).tolist()][4:]
    assert torch.equal(router_indices(local, 0), routes[tokens, 0])
    assert local_mask.shape == (1, 4)


@pytest.mark.parametrize("freq", [1, 2, 3, [0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0]])
def test_dense_layer_mapping_against_a_counting_reference(freq):
    config = types.SimpleNamespace(num_layers=6, moe_layer_freq=freq)
    pattern = moe_layer_pattern(config)
    ref = [bool(freq[i]) for i in range(6)] if isinstance(freq, list) else [i % freq == 0 for i in range(6)]
    assert list(pattern) == ref
    moe_layers = [i for i in range(6) if ref[i]]
    for ordinal, layer in enumerate(moe_layers):
        assert route_layer_index(layer, 6, pattern) == layer
        assert route_layer_index(layer, len(moe_layers), pattern) == ordinal


def test_dense_layer_mapping_refusals():
    pattern = (False, True, True)
    with pytest.raises(ValueError, match="marks it dense"):
        route_layer_index(0, 2, pattern)
    with pytest.raises(ValueError, match="expected num_layers = 3 \\(every layer\\) or 2"):
        route_layer_index(1, 5, pattern)
    with pytest.raises(ValueError, match="moe_layer_freq has 2 entries, expected num_layers = 3"):
        moe_layer_pattern(types.SimpleNamespace(num_layers=3, moe_layer_freq=[0, 1]))


def test_rank_slice_validates():
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, 2\\)"):
        RankSlice(cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="tp_size must be >= 1, got 0"):  # the one wording of _checks
        RankSlice(tp_size=0)


def test_stage_layer_range_uses_megatrons_offsets(world_of_one):
    from tests.megatron._models import make_config

    even = make_config(num_layers=4, pipeline_model_parallel_size=2)
    assert [stage_layer_range(even, pp_rank=r) for r in (0, 1)] == [range(0, 2), range(2, 4)]
    uneven = make_config(num_layers=5, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2)
    assert [stage_layer_range(uneven, pp_rank=r) for r in (0, 1)] == [range(0, 2), range(2, 5)]


def test_packed_per_sequence_balancing_splits_the_whole_row_like_megatron():
    """use_per_sequence_balancing=True: the packed row is one sequence cut into 2 * cp chunks."""
    cu = torch.tensor([0, 3, 8])  # documents of 3 and 5 tokens: per-document splitting would refuse them
    routes = torch.arange(8).reshape(8, 1, 1)
    mask = torch.zeros(8, dtype=torch.bool)
    for cp_rank, want in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])):
        local, _ = slice_for_rank(routes, mask, RankSlice(2, cp_rank), cu_seqlens=cu, packed_balancing="per_sequence")
        assert local.flatten().tolist() == want
    with pytest.raises(ValueError, match="sequence 0 has 3 tokens"):
        slice_for_rank(routes, mask, RankSlice(2, 0), cu_seqlens=cu)  # per_document, the default
    with pytest.raises(ValueError, match="packed_balancing='hybrid': context-parallel partitioning mode not supported"):
        slice_for_rank(routes, mask, RankSlice(2, 0), cu_seqlens=cu, packed_balancing="hybrid")
    with pytest.raises(ValueError, match="cu_seqlens covers 6 tokens, rollout_expert_indices has 8"):
        slice_for_rank(routes, mask, RankSlice(2, 0), cu_seqlens=torch.tensor([0, 6]), packed_balancing="per_sequence")
