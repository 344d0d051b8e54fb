"""The four gaps of issue 16: a rank collating its own subset could not match the global batch."""

from __future__ import annotations

import numpy as np
import torch

from torch_r3 import collate_routes


def _routes(seed=0):
    rng = np.random.default_rng(seed)
    counts = [3, 9, 5, 7]
    rows = [2, 9, 0, 6]
    dtypes = [np.uint8, np.int16, np.uint8, np.uint8]
    routes = [rng.integers(0, 200, size=(r, 4, 2)).astype(d) for r, d in zip(rows, dtypes)]
    return routes, counts


def test_seq_len_pads_a_subset_to_the_global_length():
    routes, counts = _routes()
    full = collate_routes(routes, counts)
    part = collate_routes(routes[:1], counts[:1], seq_len=full["attention_mask"].shape[1])
    for key in part:
        assert torch.equal(part[key], full[key][:1]), key


def test_dtype_fixes_the_output_dtype_whatever_the_subset_holds():
    routes, counts = _routes()
    full = collate_routes(routes, counts)  # int16: sample 1 is int16
    part = collate_routes(routes[2:], counts[2:], dtype=torch.int16)  # all uint8 here
    assert full["rollout_expert_indices"].dtype == part["rollout_expert_indices"].dtype == torch.int16


def test_balanced_filler_of_a_subset_matches_the_global_batch():
    routes, counts = _routes()
    kw = {"filler": "balanced", "num_experts": 7, "dtype": np.int16}
    full = collate_routes(routes, counts, layout="packed", **kw)
    cu = full["cu_seqlens"].tolist()
    part = collate_routes(routes[2:], counts[2:], layout="packed", sample_ids=[2, 3], **kw)
    assert torch.equal(part["rollout_expert_indices"], full["rollout_expert_indices"][cu[2] :])
    T = max(counts)
    full = collate_routes(routes, counts, **kw)
    part = collate_routes(routes[3:], counts[3:], seq_len=T, sample_ids=[3], **kw)
    assert torch.equal(part["rollout_expert_indices"], full["rollout_expert_indices"][3:])


def test_layers_collates_only_a_stage_s_layers_in_their_order():
    routes, counts = _routes()
    full = collate_routes(routes, counts)
    stage = collate_routes(routes, counts, keep_layers=[3, 1])
    assert torch.equal(stage["rollout_expert_indices"], full["rollout_expert_indices"][:, :, [3, 1]])
