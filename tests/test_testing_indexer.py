"""`IndexerLM`: real indexers prefilled in chunks give what one whole-sequence pass of them gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_r3.indexer import IndexerSelections

pytest.importorskip("transformers")

from torch_r3.testing.indexer import IndexerLM


def _whole_sequence(lm, tokens, layer):
    """The same indexer run once over the whole sequence with a plain causal mask (no cache)."""
    ids = torch.as_tensor(tokens)
    n = ids.numel()
    pos = torch.arange(n).unsqueeze(0)
    h = lm._embed[ids].unsqueeze(0)
    for i in range(1, layer + 1):
        h = h + torch.tanh(h @ lm._mix[i])
    q = torch.nn.functional.rms_norm(h @ lm._q[layer], (h.shape[-1],))
    mask = torch.full((n, n), float("-inf")).triu(1).unsqueeze(0)
    with torch.no_grad():
        return lm._indexers[layer](h, q, lm._rotary(h, pos), mask, pos).numpy()[0]


def _want(whole, j, k):
    return list(range(j + 1)) + [-1] * (k - 1 - j) if j < k else whole[j].tolist()


def test_one_chunk_selects_exactly_what_the_indexer_selects_over_the_whole_sequence():
    lm = IndexerLM(num_layers=2, index_topk=8, chunk=64)
    tokens = np.random.default_rng(0).integers(0, 256, 40)
    got = lm.select(tokens)
    for layer in range(2):
        whole = _whole_sequence(lm, tokens, layer)
        for j in range(40):
            assert sorted(got[j, layer].tolist()) == sorted(_want(whole, j, 8)), (layer, j)


def test_chunked_prefill_agrees_with_one_pass_up_to_near_ties():
    # Other matmul shapes round differently and can flip a near tie, as an engine's kernels do.
    lm = IndexerLM(num_layers=2, index_topk=8, chunk=7)
    tokens = np.random.default_rng(0).integers(0, 256, 40)
    got = lm.select(tokens)
    for layer in range(2):
        whole = _whole_sequence(lm, tokens, layer)
        same = [len(set(got[j, layer].tolist()) & set(_want(whole, j, 8))) / 8 for j in range(8, 40)]
        assert np.mean(same) > 0.9, layer


def test_its_captures_are_valid_selections_with_shared_layers_mirrored():
    lm = IndexerLM(num_layers=3, index_topk=16, shared=(2,), chunk=32)
    dense = lm.select(np.arange(100) % 256)
    sel = IndexerSelections.from_dense(dense[:-1])  # refuses any row that is not a selection
    assert sel.layer_source == (0, 1, 1)
    with pytest.raises(ValueError, match="shared"):
        IndexerLM(num_layers=2, shared=(2,))
