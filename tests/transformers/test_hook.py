"""ReplayHook beyond the per-family exactness: layouts, checks, stats, instances, checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.transformers.hf_models import COMMON, build, experts_used, forced, inputs, make_batch, router_weights
from tests.transformers.hf_reference import forced_topk
from torch_r3.keys import ROUTER_MASK, ROUTES
from torch_r3.transformers import ReplayHook


@pytest.fixture(scope="module")
def qwen():
    return build("qwen3_moe")


@pytest.fixture(scope="module")
def deepseek():
    return build("deepseek_v3")  # dense first layer (first_k_dense_replace=1)


def test_routes_of_the_moe_layers_only_replay_like_routes_of_every_layer(deepseek):
    with ReplayHook(deepseek) as hook:
        assert hook.layers == (1, 2) and hook.num_layers == 3
        every = make_batch(hook, layers="all")
        only = make_batch(hook, layers="moe")
        assert only[ROUTES].shape[2] == 2 and torch.equal(only[ROUTES], every[ROUTES][:, :, 1:])
        with torch.no_grad():
            with hook.replay(every):
                a = deepseek(**inputs(every)).logits
            with hook.replay(only):
                b = deepseek(**inputs(only)).logits
        assert torch.equal(a, b)
        wrong = {**every, ROUTES: every[ROUTES][:, :, :1]}
        with pytest.raises(
            ValueError, match=r"has 1 layers; expected num_layers = 3 \(every layer\) or 2 \(MoE layers only\)"
        ):
            with hook.replay(wrong):
                pass


def test_last_stats_counts_drift_per_layer_and_tokens_against_an_independent_count(qwen):
    with ReplayHook(qwen) as hook:
        batch = make_batch(hook)
        with torch.no_grad(), hook.record() as rec:
            qwen(**inputs(batch))
        routes = rec.batch[ROUTES].clone()
        last = hook.layers[-1]
        # Change the last MoE layer's experts at some captured tokens: earlier layers keep their own choice.
        changed = torch.zeros(routes.shape[:2], dtype=torch.bool)
        changed[0, 1:4] = True
        changed[1, 3] = True
        routes[changed, last] = (routes[changed, last] + 1) % hook.num_experts
        mask = batch[ROUTER_MASK]
        differs = (routes[..., last, :].sort(-1).values != rec.batch[ROUTES][..., last, :].sort(-1).values).any(-1)
        with torch.no_grad(), hook.replay({ROUTES: routes, ROUTER_MASK: mask}):
            qwen(**inputs(batch))
        stats = hook.last_stats
        captured = int((~mask).sum())
        assert stats.microbatches == 1
        assert stats.route_drift[hook.layers[0]] == 0.0
        assert stats.route_drift[last] == pytest.approx(int((differs & ~mask).sum()) / captured)
        assert stats.route_drift[last] > 0
        # The replayed batch holds no attention_mask: its padding is each row's leading uncaptured run,
        # which here is the collated attention_mask's zeros. Counted apart from the real tokens.
        padding = int((batch["attention_mask"] == 0).sum())
        live = int(mask.sum()) - padding
        assert stats.tokens == (captured, live, 0, padding) and padding > 0
        assert stats.live_fraction == pytest.approx(live / (mask.numel() - padding))


def test_packed_sequences_replay_exactly_and_match_the_unpacked_sequences(qwen):
    ref = copy.deepcopy(qwen)
    with ReplayHook(qwen) as hook:
        packed = make_batch(hook, layout="packed")
        bounds = packed["cu_seqlens"].tolist()
        positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
        # transformers detects packing from position_ids only without a KV cache (use_cache=False).
        args = {"input_ids": packed["input_ids"][None], "position_ids": positions, "use_cache": False}
        with torch.no_grad():
            with hook.replay(packed):
                out = qwen(**args).logits[0]
            with forced_topk(hook.num_experts, hook.topk, forced(hook, packed), packed[ROUTER_MASK]):
                want = ref(**args).logits[0]
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            # Packing via position_ids isolates the sequences: each equals its own unpadded run.
            for a, b in zip(bounds[:-1], bounds[1:]):
                one = {ROUTES: packed[ROUTES][a:b][None], ROUTER_MASK: packed[ROUTER_MASK][a:b][None]}
                with hook.replay(one):
                    alone = qwen(input_ids=packed["input_ids"][a:b][None]).logits[0]
                torch.testing.assert_close(out[a:b], alone, rtol=1e-5, atol=1e-5)


def test_a_router_that_sees_other_tokens_than_the_routes_cover_is_refused(qwen):
    with ReplayHook(qwen) as hook:
        batch = make_batch(hook)
        longer = torch.cat([batch["input_ids"], batch["input_ids"][:, :1]], dim=1)
        # Refused at the model's input, before any router runs (the routers also count their tokens).
        with pytest.raises(
            ValueError, match=r"replay\(\): the routes cover 6 positions per row, input_ids has 7; first"
        ):
            with torch.no_grad(), hook.replay(batch):
                qwen(input_ids=longer)


def test_filler_positions_are_checked_only_when_they_are_replayed(qwen):
    with ReplayHook(qwen) as probe:
        batch = make_batch(probe)
    routes = batch[ROUTES]
    routes[1, 0, 0] = 9  # left padding of row 1: never replayed with uncaptured="live"
    with ReplayHook(qwen) as hook, torch.no_grad(), hook.replay(batch):
        qwen(**inputs(batch))
    with ReplayHook(qwen, uncaptured="replay") as hook:
        with pytest.raises(ValueError, match=r"layer 0: row 1, token 0: expert id 9 outside \[0, 8\)"):
            with hook.replay(batch):
                pass


def test_zero_filler_rows_marked_to_replay_are_refused_naming_the_filler(qwen):
    with ReplayHook(qwen) as probe:
        batch = make_batch(probe)
    routes, mask = batch[ROUTES].clone(), batch[ROUTER_MASK]
    routes[mask] = 0  # what filler="zeros" writes into every uncaptured row
    zeros = {**batch, ROUTES: routes}
    with ReplayHook(qwen) as hook, torch.no_grad(), hook.replay(zeros):  # live: the zero rows never replay
        qwen(**inputs(zeros))
    with ReplayHook(qwen, uncaptured="replay") as hook:
        with pytest.raises(ValueError, match=r"expert id 0 twice.*all-zero filler row \(filler='zeros'\)"):
            with hook.replay(zeros):
                pass


def test_bad_layouts_are_refused_naming_the_key(qwen):
    with ReplayHook(qwen) as hook:
        batch = make_batch(hook)
        cases = [
            ({ROUTES: batch[ROUTES]}, ValueError, "missing key 'router_padding_mask'"),
            ({**batch, ROUTES: batch[ROUTES].float()}, TypeError, "expected a uint8/int16/int32/int64"),
            ({**batch, ROUTER_MASK: batch[ROUTER_MASK].long()}, TypeError, "expected a torch.bool tensor"),
            ({**batch, ROUTES: batch[ROUTES][..., :1]}, ValueError, r"expected \[B, T, L, K=2\]"),
            ({**batch, ROUTER_MASK: batch[ROUTER_MASK][:, 1:]}, ValueError, r"expected \[B, T\] = \[2, 6\]"),
            ([batch], TypeError, "expected a dict from R3Collator, got list"),
        ]
        for bad, error, match in cases:
            with pytest.raises(error, match=match), hook.replay(bad):
                pass


def test_an_unsupported_router_class_is_refused_naming_it_and_the_supported_families():
    import transformers as tf

    config = tf.FlexOlmoConfig(**COMMON, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2)
    model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate: router class FlexOlmoTopKRouter is not supported"):
        ReplayHook(model)
    with pytest.raises(ValueError, match=r"supported families: qwen3_moe \(Qwen3MoeTopKRouter\), .*gpt_oss"):
        ReplayHook(model)
    dense = tf.AutoModelForCausalLM.from_config(tf.Qwen3Config(**COMMON, num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"model \(Qwen3ForCausalLM\): no MoE router found"):
        ReplayHook(dense)
    with pytest.raises(ValueError, match=r"uncaptured must be one of \['live', 'replay'\], got 'own'"):
        ReplayHook(build("mixtral"), uncaptured="own")


def test_a_router_inside_torchs_checkpoint_wrapper_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build("olmoe")
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    with pytest.raises(ValueError, match=r"layers.1._checkpoint_wrapped_module.mlp.gate: .* checkpoint_wrapper"):
        ReplayHook(model)


def test_only_the_hooked_instance_replays_and_only_inside_the_block(qwen):
    other = copy.deepcopy(qwen)
    cls_forward = type(qwen.model.layers[0].mlp.gate).forward
    with torch.no_grad():
        batch = make_batch(ReplayHook(other))
        plain = qwen(**inputs(batch)).logits
        with ReplayHook(qwen) as hook:
            with hook.replay(batch):
                replayed = qwen(**inputs(batch)).logits
                assert torch.equal(other(**inputs(batch)).logits, plain)  # same class, other instance
            assert not torch.equal(replayed, plain)
            assert torch.equal(qwen(**inputs(batch)).logits, plain)  # outside the block
        assert type(qwen.model.layers[0].mlp.gate).forward is cls_forward
        assert all(not m._forward_hooks for m in qwen.modules())  # close() removed every hook


def test_blocks_do_not_nest_and_a_closed_hook_refuses(qwen):
    hook = ReplayHook(qwen)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate: this router already belongs to an open ReplayHook"):
        ReplayHook(qwen)
    batch = make_batch(hook)
    with hook.replay(batch), pytest.raises(RuntimeError, match="do not nest"), hook.record():
        pass
    with pytest.raises(RuntimeError, match="exactly one forward of the model in the block, got 0"), hook.record():
        pass
    hook.close()
    with pytest.raises(RuntimeError, match="closed"), hook.replay(batch):
        pass


@pytest.fixture
def checkpointed():
    model = build("qwen3_moe").train()
    ref = copy.deepcopy(model)
    return model, ref


def _loss(logits, batch):
    return logits[batch["attention_mask"].bool()].logsumexp(-1).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_recompute_exactly_the_first_forwards_experts(checkpointed, reentrant):
    model, ref = checkpointed
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    with ReplayHook(model) as hook:
        batches = [make_batch(hook, seed=s) for s in (1, 2)]
        # Two microbatches forward before one backward (gradient accumulation): each recompute
        # must find its own microbatch's experts, whichever order backward visits them in.
        loss = sum(_loss(_replayed(hook, model, b), b) for b in batches)
        loss.backward()
        assert hook.last_stats.microbatches == 1
    for b in batches:
        with forced_topk(hook.num_experts, hook.topk, forced(hook, b), b[ROUTER_MASK].reshape(-1)):
            want = _loss(ref(**inputs(b)).logits, b)
        want.backward()
    got, expected = router_weights(model), router_weights(ref)
    for name, p in got.items():
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def _replayed(hook, model, batch):
    with hook.replay(batch):
        return model(**inputs(batch)).logits


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_keeps_the_live_rows_of_the_first_forward_when_the_router_would_now_choose_otherwise(
    checkpointed, reentrant
):
    model, _ = checkpointed
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    with ReplayHook(model) as hook:
        batch = make_batch(hook)
        uncaptured = batch[ROUTER_MASK].reshape(-1)
        calls, handles = experts_used(model)
        logits = _replayed(hook, model, batch)
        first, calls[:] = list(calls), []
        with torch.no_grad():  # the router would now pick other experts at the live rows
            for p in router_weights(model).values():
                p.neg_()
            with hook.replay(batch):
                model.eval()(**inputs(batch))
            model.train()
        now, calls[:] = list(calls), []
        assert any(not torch.equal(a[uncaptured], b[uncaptured]) for a, b in zip(first, now))
        _loss(logits, batch).backward()
        for h in handles:
            h.remove()
    recomputed = calls[::-1]  # backward recomputes the last layer first
    assert len(recomputed) == len(first) == len(hook.layers)
    for a, b in zip(first, recomputed):
        assert torch.equal(a, b)


def test_step_gathers_the_stats_of_all_its_microbatches(qwen):
    with ReplayHook(qwen) as hook, torch.no_grad():
        batches = [make_batch(hook, seed=s) for s in (3, 4)]
        singles = []
        for b in batches:
            with hook.replay(b):
                qwen(**inputs(b))
            singles.append(hook.last_stats)
        with hook.step():
            for b in batches:
                with hook.replay(b):
                    qwen(**inputs(b))
            with pytest.raises(RuntimeError, match="steps do not nest"):
                with hook.step():
                    pass
        stats = hook.last_stats
    assert stats.microbatches == 2
    assert stats.tokens == tuple(a + b for a, b in zip(*(s.tokens for s in singles)))
    for layer in hook.layers:  # both microbatches capture the same number of tokens: drift is the mean
        assert stats.route_drift[layer] == pytest.approx(sum(s.route_drift[layer] for s in singles) / 2)
