"""`torch_r3.megatron.indexer.IndexerReplayHook` on a real megatron-core 0.19 DSA GPT, on the CPU.

The exact test compares each `DSAttention` output under replay with a dense
attention computed here from the layer's own inputs, masked to the batch's
selection: no Megatron code in the reference.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from torch_r3.megatron.indexer import dsa_module


def _has_dsa() -> bool:
    try:
        dsa_module()
    except ImportError:
        return False
    return True


HAS_DSA = _has_dsa()

needs_dsa = pytest.mark.skipif(not HAS_DSA, reason="this megatron-core has no DSA the hook replays (0.19 has)")

T = 10
REAL = (10, 7)


@pytest.mark.skipif(HAS_DSA, reason="this megatron-core has the DSA the hook replays")
def test_a_megatron_core_without_the_replayable_dsa_is_refused_clearly(world_of_one):
    from megatron.core import __version__

    from torch_r3.megatron.indexer import IndexerReplayHook

    with pytest.raises(ImportError, match=rf"megatron-core {re.escape(__version__)}\b.*needs megatron-core 0\.19"):
        IndexerReplayHook(torch.nn.Linear(2, 2), config=object())


@pytest.fixture
def dsa_model(cpu_megatron):
    from tests.megatron._dsa_models import build_dsa_model

    torch.manual_seed(0)
    return build_dsa_model()


def _batch(layers=3, real=REAL, seed=1):
    from tests.megatron._dsa_models import random_selections

    g = torch.Generator().manual_seed(seed)
    sel, mask = random_selections(real, T, 2, generator=g)
    sel = sel[:, :, [0, 0, 1]] if layers == 3 else sel  # layer 1 shares layer 0's top-k
    ids = torch.randint(0, 64, (len(real), T), generator=g)
    return {"input_ids": ids, "rollout_indexer_topk": sel, "indexer_padding_mask": mask}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    ids = batch["input_ids"]
    out = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)

    def loss(output):
        total = output.float().pow(2).mean()
        return total, {"loss": total.detach()}

    return out, loss


def _run(hook, model, batches, forward_only=True):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return hook.forward_backward(
        get_forward_backward_func(),
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=T,
        micro_batch_size=batches[0]["input_ids"].shape[0],
        forward_only=forward_only,
    )


class Capture:
    """Each DSAttention's inputs and output, per call."""

    def __init__(self, model):
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

        self.calls: dict[int, list] = {}
        self.handles = []
        for module in model.modules():
            if isinstance(module, DSAttention):
                layer = module.layer_number - 1
                self.calls[layer] = []
                self.handles.append(module.register_forward_hook(self._keep(layer), with_kwargs=True))

    def _keep(self, layer):
        def hook(module, args, kwargs, output):
            names = ("query", "key", "value", "attention_mask", "x", "qr")
            given = dict(zip(names, args)) | kwargs
            self.calls[layer].append((module, {k: v for k, v in given.items()}, output.detach().clone()))

        return hook


def dense_reference(module, inputs, selection):
    """DSAttention's output from its inputs, attending to `selection` ([B, S, K], -1 unused) only."""
    query, key, value = inputs["query"], inputs["key"], inputs.get("value")
    up_v = inputs.get("up_v_weight")
    sq, b, heads, _ = query.shape
    allowed = torch.zeros(b, sq, key.shape[0], dtype=torch.bool)
    for bi in range(b):
        for s in range(sq):
            for p in selection[bi, s].tolist():
                if p >= 0:
                    allowed[bi, s, p] = True
    scores = torch.einsum("sbhd,tbd->bhst", query.double(), key[:, :, 0].double()) * module.softmax_scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = scores.softmax(-1)
    if value is None:  # absorbed MLA: the latent value is the key's first kv_lora_rank channels
        rank = up_v.shape[-1]
        latent = torch.einsum("bhst,tbc->sbhc", probs, key[:, :, 0, :rank].double())
        out = torch.einsum("sbhc,hdc->sbhd", latent, up_v.double())
    else:
        out = torch.einsum("bhst,tbhd->sbhd", probs, value.double())
    return out.reshape(sq, b, -1).float()


@needs_dsa
@pytest.mark.parametrize("uncaptured", ["replay", "live"])
def test_replay_is_exact_against_a_dense_attention_forced_to_the_selection(dsa_model, uncaptured):
    from torch_r3.megatron.indexer import IndexerReplayHook

    batch = _batch()
    live = Capture(dsa_model)
    with torch.no_grad():
        _forward_step(iter([batch]), dsa_model)
    for h in live.handles:
        h.remove()
    hook = IndexerReplayHook(dsa_model, uncaptured=uncaptured)
    assert (hook.layers, hook.indexer_layers, hook.sources()) == ((0, 1, 2), (0, 2), {0: 0, 1: 0, 2: 2})
    seen = Capture(dsa_model)
    _run(hook, dsa_model, [batch])
    sel, mask = batch["rollout_indexer_topk"].long(), batch["indexer_padding_mask"]
    captured = ~mask
    for layer in (0, 1, 2):
        ((module, inputs, out),) = seen.calls[layer]
        forced = sel[:, :, layer]
        if uncaptured == "replay":  # an uncaptured query attends to itself
            itself = torch.full_like(forced, -1)
            itself[..., 0] = torch.arange(T)
            forced = torch.where(mask.unsqueeze(-1), itself, forced)
        ref = dense_reference(module, inputs, forced).transpose(0, 1)  # [B, S, H]
        got = out.transpose(0, 1)
        rows = slice(None) if uncaptured == "replay" else captured
        torch.testing.assert_close(got[rows], ref[rows], rtol=1e-4, atol=1e-5)
        if layer == 0:  # same inputs as the model without the hook: the selection really changed the output
            own = live.calls[0][0][2].transpose(0, 1)
            assert not torch.allclose(got[captured], own[captured], atol=1e-4)
            if uncaptured == "live":  # queries without a selection use the layer's own top-k
                torch.testing.assert_close(got[mask], own[mask])
    stats = hook.last_stats
    assert stats.captured_rows == int(captured.sum()) and stats.forwards == 1
    assert set(stats.overlap) == {0, 2} and all(0.0 <= v < 1.0 for v in stats.overlap.values())


@needs_dsa
@pytest.mark.parametrize("uncaptured", ["replay", "live"])
@pytest.mark.parametrize("with_attention_mask", [True, False])
def test_padding_rows_are_counted_apart_as_the_routes_statistics_count_them(dsa_model, uncaptured, with_attention_mask):
    """Left padding is neither a live nor a replayed query row: `live_fraction` is over the real rows only."""
    from torch_r3.megatron.indexer import IndexerReplayHook

    batches = [_batch(seed=1), _batch(seed=2)]
    if with_attention_mask:  # otherwise padding is each row's leading run of uncaptured rows
        att = torch.zeros(len(REAL), T, dtype=torch.long)
        for b, n in enumerate(REAL):
            att[b, T - n :] = 1
        batches = [{**b, "attention_mask": att} for b in batches]
    hook = IndexerReplayHook(dsa_model, uncaptured=uncaptured)
    _run(hook, dsa_model, batches)
    stats = hook.last_stats
    padding = sum(T - n for n in REAL) * len(batches)
    last = len(REAL) * len(batches)  # each sample's last token has no selection
    live = last if uncaptured == "live" else 0
    assert stats.live_rows == live  # padding rows are not live queries
    assert (stats.captured_rows, stats.live_rows, stats.filler_rows, stats.padding_rows) == (
        sum(REAL) * len(batches) - last,
        live,
        last - live,
        padding,
    )
    assert stats.live_fraction == live / (sum(REAL) * len(batches))
    assert stats.forwards == len(batches)


@needs_dsa
def test_the_indexer_loss_path_attends_with_the_replayed_selection(cpu_megatron):
    """In training with dsa_indexer_loss_coeff > 0 Megatron computes the top-k inside its indexer-loss function."""
    from tests.megatron._dsa_models import build_dsa_model
    from torch_r3.megatron.indexer import IndexerReplayHook

    torch.manual_seed(0)
    model = build_dsa_model(dsa_indexer_loss_coeff=0.01)
    batch = _batch()
    hook = IndexerReplayHook(model)
    seen = Capture(model)
    _run(hook, model, [batch], forward_only=False)
    sel, captured = batch["rollout_indexer_topk"].long(), ~batch["indexer_padding_mask"]
    for layer in (0, 2):
        ((module, inputs, out),) = seen.calls[layer]
        ref = dense_reference(module, inputs, sel[:, :, layer]).transpose(0, 1)
        torch.testing.assert_close(out.transpose(0, 1)[captured], ref[captured], rtol=1e-4, atol=1e-5)
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0
        for p in model.decoder.layers[0].self_attention.core_attention.indexer.parameters()
    )


@needs_dsa
def test_outside_a_step_and_after_close_the_model_is_unchanged(dsa_model):
    from torch_r3.megatron.indexer import IndexerReplayHook

    batch = _batch()
    with torch.no_grad():
        before, _ = _forward_step(iter([batch]), dsa_model)
        with IndexerReplayHook(dsa_model):
            during, _ = _forward_step(iter([batch]), dsa_model)  # no step: Megatron's own top-k
            assert all("forward" in vars(m) for m in _dsa_layers(dsa_model, computing=True))
        after, _ = _forward_step(iter([batch]), dsa_model)
    assert torch.equal(before, during) and torch.equal(before, after)
    assert not any("forward" in vars(m) for m in _dsa_layers(dsa_model))
    IndexerReplayHook(dsa_model).close()  # the layers are free again


def _dsa_layers(model, computing=False):
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    return [m for m in model.modules() if isinstance(m, DSAttention) and not (computing and m.skip_topk)]


@needs_dsa
def test_the_indexer_layers_only_layout_replays_the_same(dsa_model):
    from torch_r3.megatron.indexer import IndexerReplayHook

    every, only = _batch(layers=3), _batch(layers=2)
    outs = []
    for batch in (every, only):
        hook = IndexerReplayHook(dsa_model)
        with torch.no_grad(), hook.step(forward_only=True):
            out, _ = hook.wrap_forward_step(_forward_step)(iter([batch]), dsa_model)
        hook.close()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@needs_dsa
def test_begin_and_end_microbatch_replay_what_the_wrapped_forward_step_replays(dsa_model):
    """The routes hook's two-call contract, for a forward step that cannot be wrapped."""
    from torch_r3.megatron.indexer import IndexerReplayHook

    batches = [_batch(seed=1), _batch(seed=2)]
    hook = IndexerReplayHook(dsa_model)
    with torch.no_grad(), hook.step(forward_only=True):
        wrapped = [hook.wrap_forward_step(_forward_step)(iter([b]), dsa_model)[0] for b in batches]
    wrapped_stats = hook.last_stats
    with torch.no_grad(), hook.step(forward_only=True):
        opened = []
        for b in batches:
            hook.begin_microbatch(b)
            opened.append(_forward_step(iter([b]), dsa_model)[0])
            hook.end_microbatch()
            hook.end_microbatch()  # idempotent
    with torch.no_grad():
        own = [_forward_step(iter([b]), dsa_model)[0] for b in batches]  # no step: Megatron's own top-k
    for a, b, c in zip(wrapped, opened, own):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.allclose(a, c, atol=1e-4)  # the selections were replayed
    assert hook.last_stats == wrapped_stats and hook.last_stats.forwards == 2
    with pytest.raises(RuntimeError, match=r"begin_microbatch\(\) outside IndexerReplayHook.step\(\)"):
        hook.begin_microbatch(batches[0])
    with pytest.raises(RuntimeError, match="called next.. on the data iterator more than once"), hook.step():

        def greedy(data_iterator, model):
            next(data_iterator)
            return _forward_step(data_iterator, model)

        hook.wrap_forward_step(greedy)(iter(batches), dsa_model)
    hook.close()


@needs_dsa
def test_attention_outside_the_forward_step_with_nothing_to_recompute_is_refused(dsa_model):
    """Inside a step but outside a forward step, a layer recomputes: with no microbatch queued it is refused."""
    from torch_r3.megatron.indexer import IndexerReplayHook

    message = (
        "layer 0: DSAttention ran outside the forward step with no microbatch left to recompute "
        "(0 installed, 0 recomputed); run the model only inside forward_step_func"
    )
    hook = IndexerReplayHook(dsa_model)
    with torch.no_grad(), pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"), hook.step(forward_only=True):
        _forward_step(iter([_batch()]), dsa_model)
    hook.close()


@needs_dsa
@pytest.mark.parametrize("uncaptured", ["replay", "live"])
def test_the_selections_stay_compact_until_the_attention_needs_them(dsa_model, uncaptured):
    """The hook keeps one compact copy of the replayed layers; each layer widens only its own rows.

    Counted from the tensors the hook's own code creates (`TensorMemory`), not timed.
    """
    from torch_r3.bench.tensor_memory import TensorMemory
    from torch_r3.megatron.indexer import IndexerReplayHook

    batch = _batch()
    B, _, L, K = batch["rollout_indexer_topk"].shape
    hook = IndexerReplayHook(dsa_model, uncaptured=uncaptured)
    replayed = batch["rollout_indexer_topk"][:, :, list(hook.indexer_layers)]
    compact = replayed.nbytes  # the replayed layers' selections, in the batch's int16
    masks = 3 * B * T  # this rank's uncaptured mask and padding rows (bool), their split
    meter = TensorMemory()
    choose = hook._choose

    def counted_choose(*args):
        meter.start()
        try:
            return choose(*args)
        finally:
            meter.stop()

    hook._choose = counted_choose
    with torch.no_grad(), hook.step(forward_only=True):
        with meter.counting():
            hook.begin_microbatch(batch)
        kept = meter.live
        meter.peak = kept
        _forward_step(iter([batch]), dsa_model)
        per_layer = meter.peak - kept
        hook.end_microbatch()
    assert kept <= compact + masks  # one compact copy (int64 would be 4x)
    one_layer = B * T * K  # slots of one layer's rows
    assert per_layer <= 48 * one_layer  # that layer's rows at the attention's int64, its statistics' temporaries
    assert meter.live <= meter.allocated  # the meter balances


@needs_dsa
def test_activation_recompute_replays_each_microbatchs_selection(cpu_megatron):
    """Gradients with full recompute equal those without it: recompute re-ran each layer with its microbatch's top-k."""
    from tests.megatron._dsa_models import build_dsa_model
    from torch_r3.megatron.indexer import IndexerReplayHook

    batches = [_batch(seed=1), _batch(seed=2)]
    grads = []
    for recompute in ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}):
        torch.manual_seed(0)
        model = build_dsa_model(**recompute)
        hook = IndexerReplayHook(model)
        calls = Capture(model)
        _run(hook, model, batches, forward_only=False)
        assert [len(calls.calls[layer]) for layer in (0, 1, 2)] == [4 if recompute else 2] * 3  # recompute ran
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        hook.close()
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


@needs_dsa
@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ((0, 5, 0, 0), 6, "microbatch 0, layer 0, batch row 0, position 5: selects position 6, outside [0, 5]"),
        ((1, 8, 1, 1), "twin", "microbatch 0, layer 2, batch row 1, position 8: selects a position twice"),
        ((0, 6, 0, 2), -1, "layer 0, batch row 0, position 6: selects 2 positions, expected 3"),
        ((1, 4, 0, 0), 1, "layer 0, batch row 1, position 4: selects position 1, outside [3, 4]"),  # padding
    ],
)
def test_bad_selections_are_refused_before_the_model_runs(dsa_model, where, value, message):
    from torch_r3.megatron.indexer import IndexerReplayHook

    batch = _batch(layers=2)  # the computing layers' columns: 0 and 2
    sel = batch["rollout_indexer_topk"].clone()
    sel[where] = int(sel[(*where[:3], 0)]) if value == "twin" else value
    batch["rollout_indexer_topk"] = sel
    hook = IndexerReplayHook(dsa_model)
    seen = Capture(dsa_model)
    with pytest.raises(ValueError, match=re.escape(message)):
        _run(hook, dsa_model, [batch])
    assert seen.calls[0] == []  # refused before any layer ran


@needs_dsa
def test_a_sharing_layers_column_must_equal_its_sources(dsa_model):
    from torch_r3.megatron.indexer import IndexerReplayHook

    batch = _batch()
    sel = batch["rollout_indexer_topk"].clone()
    sel[0, 4, 1] = torch.tensor([0, 1, 4]) if sel[0, 4, 0].tolist() != [0, 1, 4] else torch.tensor([1, 2, 3])
    batch["rollout_indexer_topk"] = sel
    with pytest.raises(ValueError, match="microbatch 0, rollout_indexer_topk: layer 1 reuses layer 0's top-k"):
        _run(IndexerReplayHook(dsa_model), dsa_model, [batch])


@needs_dsa
def test_layouts_the_hook_cannot_replay_are_refused(dsa_model):
    from torch_r3.megatron.indexer import IndexerReplayHook

    hook = IndexerReplayHook(dsa_model)
    batch = _batch()
    wrong_k = {**batch, "rollout_indexer_topk": batch["rollout_indexer_topk"][..., :2]}
    with pytest.raises(
        ValueError, match="microbatch 0, rollout_indexer_topk: index_topk 2, the model's dsa_indexer_topk is 3"
    ):
        _run(hook, dsa_model, [wrong_k])
    wrong_l = {**batch, "rollout_indexer_topk": batch["rollout_indexer_topk"][:, :, :1]}
    with pytest.raises(
        ValueError, match=r"has 1 layers; expected 3 \(every layer\) or 2 \(the layers with an indexer\)"
    ):
        _run(hook, dsa_model, [wrong_l])
    packed = {**batch, "cu_seqlens": torch.tensor([0, 10, 17], dtype=torch.int32)}
    with pytest.raises(ValueError, match="packed microbatch"):
        _run(hook, dsa_model, [packed])
    short = {
        **batch,
        "rollout_indexer_topk": batch["rollout_indexer_topk"][:, :8],
        "indexer_padding_mask": batch["indexer_padding_mask"][:, :8],
    }
    with pytest.raises(ValueError, match="covers 10 query rows but the batch holds 8"):
        _run(hook, dsa_model, [short])
    with pytest.raises(ValueError, match="data_iterator ran out: the schedule asked for microbatch 2 of 2, 1 arrived"):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        hook.forward_backward(
            get_forward_backward_func(),
            forward_step_func=_forward_step,
            data_iterator=iter([batch]),
            model=[dsa_model],
            num_microbatches=2,
            seq_length=T,
            micro_batch_size=2,
            forward_only=True,
        )


@needs_dsa
def test_settings_that_bypass_replay_are_refused(dsa_model):
    from megatron.core.transformer.enums import AttnBackend

    from torch_r3.megatron import InterleavedPipelineError
    from torch_r3.megatron.indexer import IndexerReplayHook

    fused = copy.copy(dsa_model.config)
    fused.attention_backend, fused.dsa_kernel_backend = AttnBackend.auto, "cudnn"
    with pytest.raises(ValueError, match="dsa_kernel_backend='cudnn'.*fused DSA kernels"):
        IndexerReplayHook(dsa_model, config=fused)
    graphs = copy.copy(dsa_model.config)
    graphs.cuda_graph_impl = "local"
    with pytest.raises(ValueError, match="cuda_graph_impl='local'"):
        IndexerReplayHook(dsa_model, config=graphs)
    vpp = copy.copy(dsa_model.config)
    vpp.virtual_pipeline_model_parallel_size = 2
    with pytest.raises(InterleavedPipelineError):
        IndexerReplayHook(dsa_model, config=vpp)
    with pytest.raises(InterleavedPipelineError):
        IndexerReplayHook([dsa_model, dsa_model])
    with pytest.raises(ValueError, match="uncaptured must be one of"):
        IndexerReplayHook(dsa_model, uncaptured="own")
    with pytest.raises(ValueError, match="selection_layers=.* does not hold layer 2"):
        IndexerReplayHook(dsa_model, selection_layers=[0, 1])
    hook = IndexerReplayHook(dsa_model)
    with pytest.raises(ValueError, match="already belongs to an open ReplayHook"):
        IndexerReplayHook(dsa_model)
    hook.close()


@needs_dsa
def test_a_model_without_dsa_is_refused(make_model):
    from torch_r3.megatron.indexer import IndexerReplayHook

    with pytest.raises(ValueError, match="experimental_attention_variant=None"):
        IndexerReplayHook(make_model())


def test_context_parallel_rows_are_cut_and_positions_kept():
    from torch_r3.megatron.indexer import selections_for_rank

    g = torch.Generator().manual_seed(3)
    B, Tn, L, K = 2, 8, 2, 3
    sel = torch.randint(-1, Tn, (B, Tn, L, K), generator=g)
    mask = torch.rand(B, Tn, generator=g) < 0.3
    for rank in range(2):
        local, local_mask, positions = selections_for_rank(sel, mask, cp_size=2, cp_rank=rank)
        chunks = [rank, 3 - rank]  # 2 * cp_size chunks of 2 rows: rank r holds r and 3 - r
        rows = [c * 2 + i for c in chunks for i in range(2)]
        assert positions.tolist() == rows
        assert torch.equal(local_mask, mask[:, rows])
        for j, t in enumerate(rows):
            for b in range(B):
                for layer in range(L):
                    kept = sorted(p for p in sel[b, t, layer].tolist() if p >= 0)
                    assert local[b, j, layer].tolist() == kept + [-1] * (K - len(kept))
    local, _, _ = selections_for_rank(sel, mask, uncaptured="replay")
    for b, t in mask.nonzero().tolist():
        assert local[b, t].tolist() == [[t, -1, -1]] * L
