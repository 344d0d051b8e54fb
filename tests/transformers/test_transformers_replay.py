"""Replay in every supported family, against the family's own forward with the experts forced.

The reference (`hf_reference.forced_topk`) runs an untouched copy of the model
with `torch.topk` overridden at the router's expert choice, so the family's own
code weights the forced experts; the hook is not involved.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.transformers.hf_models import (
    FAMILY_NAMES,
    LENGTHS,
    build,
    experts_used,
    forced,
    inputs,
    make_batch,
    router_weights,
)
from tests.transformers.hf_reference import forced_topk
from torch_r3.transformers import ReplayHook


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return build(family)


def test_logits_and_router_gradients_equal_the_forced_expert_reference(model):
    ref = copy.deepcopy(model)
    hook = ReplayHook(model)
    try:
        batch = make_batch(hook)
        real = batch["attention_mask"].bool()
        with hook.replay(batch):
            out = model(**inputs(batch)).logits
        out[real].logsumexp(-1).sum().backward()
        with forced_topk(hook.num_experts, hook.topk, forced(hook, batch), batch["router_padding_mask"].reshape(-1)):
            want = ref(**inputs(batch)).logits
        want[real].logsumexp(-1).sum().backward()
        torch.testing.assert_close(out[real], want[real], rtol=1e-5, atol=1e-5)
        # The experts really were forced: the model's own routing gives other logits.
        with torch.no_grad():
            assert not torch.allclose(model(**inputs(batch)).logits[real], want[real], atol=1e-4)
        got, expected = router_weights(model), router_weights(ref)
        assert len(got) == len(hook.layers)
        for name, p in got.items():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-4, atol=1e-6)
    finally:
        hook.close()
        model.zero_grad(set_to_none=True)


def test_uncaptured_tokens_follow_the_routers_own_choice(model):
    ref = copy.deepcopy(model)
    hook = ReplayHook(model)
    calls, handles = experts_used(model)
    try:
        batch = make_batch(hook)
        uncaptured = batch["router_padding_mask"].reshape(-1)
        with torch.no_grad(), hook.replay(batch):
            model(**inputs(batch))
        # The reference's own choice at uncaptured rows, given the same replayed history.
        with torch.no_grad(), forced_topk(hook.num_experts, hook.topk, forced(hook, batch), uncaptured) as (used, _):
            ref(**inputs(batch))
        assert len(calls) == len(used) == len(hook.layers)
        for got, want, routes in zip(calls, used, forced(hook, batch)):
            assert torch.equal(got[~uncaptured], routes[~uncaptured])
            assert torch.equal(got[uncaptured], want[uncaptured])
    finally:
        for h in handles:
            h.remove()
        hook.close()


def test_replaying_the_recorded_own_routes_reproduces_the_plain_forward_bit_for_bit(model):
    hook = ReplayHook(model)
    try:
        batch = make_batch(hook)
        with torch.no_grad():
            plain = model(**inputs(batch)).logits
            with hook.record() as rec:
                model(**inputs(batch))
            recorded = rec.batch
            assert recorded["rollout_expert_indices"].shape == (2, max(LENGTHS), hook.num_layers, hook.topk)
            assert torch.equal(recorded["router_padding_mask"], batch["attention_mask"] == 0)
            with hook.replay({**recorded, "input_ids": batch["input_ids"]}):
                again = model(**inputs(batch)).logits
        assert torch.equal(again, plain)
        assert hook.last_stats.mean_drift == 0.0
    finally:
        hook.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_in_bf16_too_replaying_the_own_routes_reproduces_the_plain_forward_bit_for_bit(family, dtype):
    model = build(family, dtype=dtype)
    with ReplayHook(model) as hook, torch.no_grad():
        batch = make_batch(hook)
        plain = model(**inputs(batch)).logits
        with hook.record() as rec:
            model(**inputs(batch))
        with hook.replay(rec.batch):
            again = model(**inputs(batch)).logits
    assert again.dtype == dtype and torch.equal(again, plain)


def test_filler_mode_replays_every_position_and_counts_filler_tokens(model):
    ref = copy.deepcopy(model)
    hook = ReplayHook(model, uncaptured="replay")
    try:
        batch = make_batch(hook)
        with torch.no_grad():
            with hook.replay(batch):
                out = model(**inputs(batch)).logits
            with forced_topk(hook.num_experts, hook.topk, forced(hook, batch)):
                want = ref(**inputs(batch)).logits
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        padding = int((batch["attention_mask"] == 0).sum())  # replayed a filler route too, but counted apart
        n_uncaptured = int(batch["router_padding_mask"].sum()) - padding
        assert hook.last_stats.tokens == (int((~batch["router_padding_mask"]).sum()), 0, n_uncaptured, padding)
    finally:
        hook.close()


@pytest.mark.parametrize("fault", ["out_of_range", "duplicate"])
def test_bad_ids_are_refused_naming_layer_and_position_before_the_model_runs(model, fault):
    hook = ReplayHook(model)
    forwards = []
    handle = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        batch = make_batch(hook)
        layer = hook.layers[-1]
        routes = batch["rollout_expert_indices"]
        if fault == "out_of_range":
            routes[1, 3, layer, 1] = hook.num_experts
            match = rf"layer {layer}: row 1, token 3: expert id {hook.num_experts} outside \[0, {hook.num_experts}\)"
        else:
            routes[1, 3, layer, 1] = routes[1, 3, layer, 0]
            match = rf"layer {layer}: row 1, token 3: expert id \d+ twice in one route"
        with pytest.raises(ValueError, match=match), hook.replay(batch):
            model(**inputs(batch))
        assert forwards == []
    finally:
        handle.remove()
        hook.close()
