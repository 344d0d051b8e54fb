"""Expert-bias, group-limited and MTP models; settings that are warned about or refused."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from tests.megatron._models import EXPERTS, RouteRecorder, expected_map, make_batch, own_choice, run_step
from torch_r3.megatron import ReplayHook


def _rows(mask):
    return mask.transpose(0, 1).reshape(-1)


def _batches(n=2, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [make_batch(generator=g) for _ in range(n)]


def _captured_rows_replayed(recorder, batches, layers):
    """Every forward call of every listed layer selected exactly the installed routes."""
    for layer in layers:
        calls = recorder.calls[layer]
        assert len(calls) >= len(batches)
        for batch, (_, routing_map) in zip(batches, calls):
            captured = ~_rows(batch["router_padding_mask"])
            installed = expected_map(batch["rollout_expert_indices"][:, :, layer])
            assert torch.equal(routing_map[captured], installed[captured])


def test_expert_bias_sigmoid_router_replays_exactly_and_counts_every_real_token_not_left_padding(make_model):
    model = make_model(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none"
    )
    routers = [m for m in model.modules() if getattr(m, "enable_expert_bias", False)]
    with torch.no_grad():
        for r in routers:
            r.expert_bias.copy_(torch.linspace(-0.5, 0.5, EXPERTS))  # the bias does steer the own choice
    batches = _batches()
    recorder = RouteRecorder(model)
    with ReplayHook(model) as hook:
        run_step(hook, model, batches)
    _captured_rows_replayed(recorder, batches, (0, 1))
    # The expert-bias update counts the tokens per expert of every real token: the
    # uncaptured ones (the last sampled token) carry loss too; left padding does not count.
    real_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    captured = sum(int((~b["router_padding_mask"]).sum()) for b in batches)
    assert real_tokens > captured
    for layer, router in recorder.routers.items():
        want = torch.zeros(EXPERTS)
        for batch, (_, routing_map) in zip(batches, recorder.calls[layer]):
            want += routing_map[_rows(batch["attention_mask"].bool())].sum(0).float()
        assert torch.equal(router.local_tokens_per_expert.float(), want)
        assert int(router.local_tokens_per_expert.sum()) == real_tokens * model.config.moe_router_topk
    recorder.close()
    # Closing restores Megatron's own method on these routers.
    assert all("_apply_expert_bias" not in vars(r) for r in routers)


def test_the_expert_bias_workaround_is_applied_only_where_the_release_has_the_bug():
    from torch_r3.megatron.routers import expert_bias_mask_is_broken

    def fixed(self, routing_map, padding_mask=None):  # the upstream fix: widen the mask
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def broken(self, routing_map, padding_mask=None):  # 0.16.1 to 0.19.2
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & (~padding_mask)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    assert not expert_bias_mask_is_broken(fixed)
    assert expert_bias_mask_is_broken(broken)
    assert expert_bias_mask_is_broken()  # every release this suite runs on still has it


def test_group_limited_router_replays_exactly_and_routes_uncaptured_tokens_within_its_groups(make_model):
    model = make_model(moe_router_num_groups=4, moe_router_group_topk=2)
    batches = _batches()
    recorder = RouteRecorder(model)
    with ReplayHook(model) as hook:
        run_step(hook, model, batches, forward_only=True)
    _captured_rows_replayed(recorder, batches, (0, 1))
    for layer, calls in recorder.calls.items():
        for batch, (_, routing_map), hidden in zip(batches, calls, recorder.inputs[layer]):
            uncaptured = _rows(batch["router_padding_mask"])
            own = own_choice(recorder.routers[layer], hidden)
            assert torch.equal(routing_map[uncaptured], own[uncaptured])
    recorder.close()


def test_mtp_model_is_accepted_decoder_routes_replay_and_mtp_routers_route_live(make_model):
    model = make_model(mtp_num_layers=1)
    mtp_layer = model.mtp.layers[0]
    # megatron-core 0.17 renamed MultiTokenPredictionLayer.transformer_layer to mtp_model_layer.
    inner = getattr(mtp_layer, "mtp_model_layer", None) or mtp_layer.transformer_layer
    mtp_router = inner.mlp.router
    decoder_routers = [layer.mlp.router for layer in model.decoder.layers]
    # Routers are told apart by their place in the model, not by layer_number:
    # newer Megatron numbers MTP layers from 1 again.
    mtp_router.layer_number = 1
    decoder_routers[0].layer_number = 7
    hook = ReplayHook(model)
    assert hook.layers == (0, 1)
    mtp_router.layer_number = 3
    decoder_routers[0].layer_number = 1
    batches = _batches()
    recorder = RouteRecorder(model)
    run_step(hook, model, batches)
    recorder.close()
    _captured_rows_replayed(recorder, batches, (0, 1))
    mtp_calls = recorder.calls[2]
    assert len(mtp_calls) == len(batches)
    for (action, routing_map), hidden in zip(mtp_calls, recorder.inputs[2]):
        assert action is None
        assert torch.equal(routing_map, own_choice(mtp_router, hidden))
    assert hook.last_stats.route_drift.keys() == {0, 1}
    hook.close()


def test_capacity_factor_warns_once_at_construction_naming_the_setting(make_model):
    model = make_model(moe_expert_capacity_factor=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = ReplayHook(model)
        run_step(hook, model, _batches(2), forward_only=True)
    ours = [w for w in caught if "moe_expert_capacity_factor" in str(w.message)]
    assert len(ours) == 1
    assert "moe_expert_capacity_factor=1.0" in str(ours[0].message)
    assert "dropped" in str(ours[0].message)


def _with(config, **fields):
    config = dataclasses.replace(config)
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


def test_overlapped_expert_parallel_communication_is_refused(make_model):
    model = make_model()
    with pytest.raises(ValueError, match=r"overlap_moe_expert_parallel_comm=True"):
        ReplayHook(model, _with(model.config, overlap_moe_expert_parallel_comm=True))
