"""Indexer replay in `transformers` DSA models: exact against a model whose indexers are forced to the
captured selection, live uncaptured queries, R2, activation checkpointing, checks at use."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.transformers.hf_models import build
from torch_r3.collate.selections import SELECTION_MASK, SELECTIONS, collate_selections
from torch_r3.indexer import IndexerSelections
from torch_r3.transformers import ReplayHook
from torch_r3.transformers.indexer import DSAReplayHook, IndexerReplayHook

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
LENGTHS = (9, 6)  # left padding in row 1; index_topk is 3, so most rows really select


def _indexers(model):
    return {m.layer_idx: m for m in model.modules() if type(m).__name__.endswith("Indexer")}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    ids = torch.zeros((len(LENGTHS), T), dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        ids[b, T - n :] = torch.randint(3, 64, (n,), generator=g)
        att[b, T - n :] = 1
    return ids, att


def _capture(model, ids, att):
    """Each sample's dense selections as an engine sends them: its own positions, rows n - 1, every layer.

    Read straight from the indexers' outputs with plain forward hooks; shared layers take the last full one.
    """
    raw = {}
    handles = [
        m.register_forward_hook(lambda mod, a, out, i=i: raw.__setitem__(i, out)) for i, m in _indexers(model).items()
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=att)
    for h in handles:
        h.remove()
    layers = model.config.num_hidden_layers
    K = next(iter(_indexers(model).values())).index_topk
    T = ids.shape[1]
    out = []
    for b, n in enumerate(LENGTHS):
        s = T - n
        dense = np.full((n - 1, layers, K), -1, dtype=np.int32)
        src = None
        for layer in range(layers):
            src = layer if layer in raw else src
            for j in range(n - 1):
                keep = [int(p) - s for p in raw[src][b, s + j].tolist() if s <= int(p) <= s + j]
                dense[j, layer, : len(keep)] = keep
        out.append(dense)
    return out


def _forced(model, dense, ids, att):
    """A copy of `model` whose indexers return `dense` for captured queries and their own for the rest."""
    forced = copy.deepcopy(model)
    T = ids.shape[1]
    for layer, m in _indexers(forced).items():
        original = m.forward

        def forward(*args, layer=layer, original=original, **kwargs):
            own = original(*args, **kwargs)
            out = own.clone()
            for b, n in enumerate(LENGTHS):
                s = T - n
                for j in range(dense[b].shape[0]):
                    chosen = [int(p) + s for p in dense[b][j, layer] if p >= 0]
                    chosen += [chosen[0]] * (own.shape[-1] - len(chosen))  # a repeat masks nothing more
                    out[b, s + j] = torch.tensor(chosen, dtype=own.dtype)
            return out

        m.forward = forward
    return forced


def _batch(dense, ids, att):
    sels = [IndexerSelections.from_dense(d) for d in dense]
    return {**collate_selections(sels, list(LENGTHS)), "input_ids": ids, "attention_mask": att}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_logits_and_gradients_equal_the_forced_reference(family):
    model, other = build(family), build(family, seed=1)
    ids, att = _inputs()
    dense = _capture(other, ids, att)  # another model's choice: differs from this one's
    batch = _batch(dense, ids, att)
    reference = _forced(model, dense, ids, att)
    hook = IndexerReplayHook(model)
    with hook.replay(batch):
        logits = model(input_ids=ids, attention_mask=att).logits
    want = reference(input_ids=ids, attention_mask=att).logits
    assert torch.equal(logits, want)
    plain = model(input_ids=ids, attention_mask=att).logits
    assert not torch.equal(logits, plain)  # replay changed what the attention saw
    logits.sum().backward()
    want.sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    stats = hook.last_stats
    assert stats.forwards == 1 and stats.captured_rows == sum(LENGTHS) - 2
    assert set(stats.overlap) == set(hook.indexer_layers) and stats.mean_overlap < 1.0


def test_recorded_own_selections_replay_to_the_plain_forward_bit_for_bit(family):
    model = build(family)
    ids, att = _inputs(1)
    hook = IndexerReplayHook(model)
    with torch.no_grad(), hook.record() as rec:
        plain = model(input_ids=ids, attention_mask=att).logits
    assert rec.batch[SELECTIONS].shape == (2, 9, 3, 3)
    assert rec.batch[SELECTION_MASK].tolist() == (att == 0).tolist()
    with torch.no_grad(), hook.replay(rec.batch):
        again = model(input_ids=ids, attention_mask=att).logits
    assert torch.equal(plain, again)
    assert hook.last_stats.mean_overlap == 1.0
    # The recording matches what the engine would send, decoded and collated.
    dense = _capture(model, ids, att)
    ref = collate_selections([IndexerSelections.from_dense(d) for d in dense], list(LENGTHS))
    captured = ~ref[SELECTION_MASK]
    assert torch.equal(rec.batch[SELECTIONS][captured], ref[SELECTIONS][captured])


def test_uncaptured_queries_use_the_live_indexer(family):
    model, other = build(family), build(family, seed=1)
    ids, att = _inputs(2)
    dense = _capture(other, ids, att)
    dense = [d[:3] for d in dense]  # only 3 captured rows each: the rest must be live
    batch = {**collate_selections([IndexerSelections.from_dense(d) for d in dense], list(LENGTHS))}
    reference = _forced(model, dense, ids, att)
    with torch.no_grad(), IndexerReplayHook(model).replay(batch):
        logits = model(input_ids=ids, attention_mask=att).logits
    assert torch.equal(logits, reference(input_ids=ids, attention_mask=att).logits)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_recompute_replays_the_forward_s_selections(family, reentrant):
    model, other = build(family), build(family, seed=1)
    ids, att = _inputs(3)
    batch = _batch(_capture(other, ids, att), ids, att)
    plain = copy.deepcopy(model).train()
    with IndexerReplayHook(plain).replay(batch):
        plain(input_ids=ids, attention_mask=att).logits.sum().backward()
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    with IndexerReplayHook(model).replay(batch):
        loss = model(input_ids=ids, attention_mask=att).logits.sum()
    loss.backward()  # the recompute runs here, after the block
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def test_one_dsa_hook_replays_routes_and_selections(family):
    model, other = build(family), build(family, seed=1)
    ids, att = _inputs(4)
    dense = _capture(other, ids, att)
    with torch.no_grad(), ReplayHook(other).record() as routes:
        other(input_ids=ids, attention_mask=att)
    batch = {**_batch(dense, ids, att), **routes.batch}
    reference = _forced(model, dense, ids, att)
    with torch.no_grad(), ReplayHook(reference).replay(batch):
        want = reference(input_ids=ids, attention_mask=att).logits
    hook = DSAReplayHook(model)
    with torch.no_grad(), hook.replay(batch):
        got = model(input_ids=ids, attention_mask=att).logits
    assert torch.equal(got, want)
    with torch.no_grad(), hook.record() as (rec_routes, rec_sel):
        plain = model(input_ids=ids, attention_mask=att).logits
    with torch.no_grad(), hook.replay({**rec_routes.batch, **rec_sel.batch}):
        assert torch.equal(model(input_ids=ids, attention_mask=att).logits, plain)


def _bad(sel, b, t, layer, values):
    out = sel.clone()
    out[b, t, layer] = torch.tensor(values, dtype=out.dtype)
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: _bad(s, 1, 7, 0, [3, 7, 9]), "layer 0, batch row 1, position 7: selects position 9, outside"),
        (lambda s: _bad(s, 1, 7, 0, [2, 5, 7]), "selects position 2, outside \\[3, 7\\]"),
        (lambda s: _bad(s, 0, 7, 0, [4, 4, 6]), "layer 0, batch row 0, position 7: selects a position twice"),
        (lambda s: _bad(s, 0, 7, 0, [4, 6, -1]), "selects 2 positions, expected 3"),
        (lambda s: _bad(s, 0, 1, 0, [0, -1, -1]), "position 1: selects 1 positions, expected 2"),
    ],
)
def test_a_bad_selection_is_refused_before_the_model_runs(edit, message):
    model = build("deepseek_v32")
    ids, att = _inputs()
    batch = _batch(_capture(model, ids, att), ids, att)
    batch[SELECTIONS] = edit(batch[SELECTIONS])
    hook = IndexerReplayHook(model)
    with pytest.raises(ValueError, match=message):
        with hook.replay(batch):
            raise AssertionError("the block must not run")


def test_a_shared_layer_whose_capture_differs_from_its_source_is_refused():
    model = build("glm_moe_dsa")  # layers full, shared, full
    ids, att = _inputs()
    batch = _batch(_capture(model, ids, att), ids, att)
    hook = IndexerReplayHook(model)
    assert hook.sources() == (0, 0, 2)
    batch[SELECTIONS][:, :, 1] = batch[SELECTIONS][:, :, 2]
    with pytest.raises(ValueError, match="layer 1 reuses layer 0's top-k"):
        with hook.replay(batch):
            pass


@pytest.mark.parametrize("uncaptured", ["live", "replay"])
@pytest.mark.parametrize("with_attention_mask", [True, False])
def test_padding_rows_are_counted_apart_as_the_routes_statistics_count_them(uncaptured, with_attention_mask):
    """Left padding is neither a live nor a replayed query row: `live_fraction` is over the real rows only."""
    model = build("deepseek_v32")
    ids, att = _inputs()
    batch = _batch(_capture(model, ids, att), ids, att)
    if not with_attention_mask:  # padding is then each row's leading run of uncaptured rows
        batch.pop("attention_mask")
    T = ids.shape[1]
    padding = sum(T - n for n in LENGTHS)
    last = len(LENGTHS)  # each sample's last token has no selection (seqlen - 1 rows)
    with torch.no_grad(), IndexerReplayHook(model, uncaptured=uncaptured).replay(batch) as hook:
        model(input_ids=ids, attention_mask=att)
    stats = hook.last_stats
    live = last if uncaptured == "live" else 0
    assert stats.live_rows == live  # padding rows are not live queries
    assert (stats.captured_rows, stats.live_rows, stats.filler_rows, stats.padding_rows) == (
        sum(LENGTHS) - last,
        live,
        last - live,
        padding,
    )
    assert stats.live_fraction == live / sum(LENGTHS)
    assert stats.captured_rows + stats.live_rows + stats.filler_rows + stats.padding_rows == ids.numel()


@pytest.mark.parametrize("uncaptured", ["live", "replay"])
def test_the_selections_stay_compact_until_the_attention_needs_them(uncaptured):
    """The hook keeps no copy of the selections (int64 would be 4x); each indexer call widens its own layer only.

    Counted from the tensors the hook's own code creates (`TensorMemory`), not timed.
    """
    from torch_r3.bench.tensor_memory import TensorMemory

    model = build("deepseek_v32")
    ids, att = _inputs()
    batch = _batch(_capture(model, ids, att), ids, att)
    B, T, L, K = batch[SELECTIONS].shape
    hook = IndexerReplayHook(model, uncaptured=uncaptured)
    meter = TensorMemory()
    for m in _indexers(model).values():  # around the hook's own forward hook on each indexer
        m.register_forward_hook(lambda *a: meter.start(), prepend=True)
        m.register_forward_hook(lambda *a: meter.stop())
    block = hook.replay(batch)
    with torch.no_grad():
        with meter.counting():
            block.__enter__()
        kept = meter.live
        meter.peak = kept
        model(input_ids=ids, attention_mask=att)
        per_layer = meter.peak - kept
        block.__exit__(None, None, None)
    assert kept <= B * T + 8 * B < batch[SELECTIONS].nbytes  # the padding rows and first positions only
    assert per_layer <= 32 * B * T * K  # one layer's rows at the attention's int32, its statistics' temporaries
    assert hook.last_stats.forwards == 1


def test_misuse_is_refused():
    model = build("deepseek_v32")
    ids, att = _inputs()
    batch = _batch(_capture(model, ids, att), ids, att)
    hook = IndexerReplayHook(model)
    with pytest.raises(ValueError, match="indexer: this router already belongs to an open ReplayHook"):
        IndexerReplayHook(model)
    with pytest.raises(ValueError, match=r"the indexer sees \[1, 9\] queries but the batch covers \[2, 9\]"):
        with hook.replay(batch):
            model(input_ids=ids[:1], attention_mask=att[:1])
    with pytest.raises(ValueError, match="missing"):
        with hook.replay({"input_ids": ids}):
            pass
    with pytest.raises(ValueError, match="no DSA indexer found"):
        IndexerReplayHook(build("deepseek_v3"))
    hook.close()
    IndexerReplayHook(model).close()  # closed: the model takes a new hook
