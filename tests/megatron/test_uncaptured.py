"""Tokens without a captured route route live (or replay filler); per-step ReplayStats."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.megatron._models import TOPK, RouteRecorder, expected_map, make_batch, own_choice, run_step
from torch_r3.megatron import ReplayHook, ReplayStats


def _rows(mask):
    """[B, T] -> [T*B] in the router's sequence-first token order."""
    return mask.transpose(0, 1).reshape(-1)


def _batches(n=2, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [make_batch(generator=g) for _ in range(n)]


def test_uncaptured_tokens_route_exactly_as_the_models_own_router_by_default(make_model):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    model = make_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    hook = ReplayHook(model)  # uncaptured="live" is the default
    batches = _batches()
    recorder = RouteRecorder(model)
    run_step(hook, model, batches)
    for layer, calls in recorder.calls.items():
        forwards = [i for i, (action, _) in enumerate(calls) if action == RouterReplayAction.REPLAY_FORWARD]
        recomputes = [i for i, (action, _) in enumerate(calls) if action == RouterReplayAction.REPLAY_BACKWARD]
        assert len(forwards) == len(recomputes) == len(batches)
        for batch, f, r in zip(batches, forwards, recomputes):
            routing_map = calls[f][1]
            uncaptured = _rows(batch["router_padding_mask"])
            # Among them the last real token of each row, which the engine sampled but never routed.
            assert bool(_rows(batch["attention_mask"].bool())[uncaptured].any())
            own = own_choice(recorder.routers[layer], recorder.inputs[layer][f])
            assert torch.equal(routing_map[uncaptured], own[uncaptured])
            installed = expected_map(batch["rollout_expert_indices"][:, :, layer])
            assert torch.equal(routing_map[~uncaptured], installed[~uncaptured])
            assert torch.equal(calls[r][1], routing_map)  # recompute routes as the forward did
    recorder.close()


def test_uncaptured_replay_keeps_the_filler_routes(make_model):
    model = make_model()
    hook = ReplayHook(model, uncaptured="replay")
    batches = _batches(1)
    recorder = RouteRecorder(model)
    run_step(hook, model, batches, forward_only=True)
    recorder.close()
    for layer, ((_, routing_map),) in recorder.calls.items():
        assert torch.equal(routing_map, expected_map(batches[0]["rollout_expert_indices"][:, :, layer]))


def test_uncaptured_must_be_live_or_replay(make_model):
    with pytest.raises(ValueError, match=r"uncaptured must be one of \['live', 'replay'\], got 'own'"):
        ReplayHook(make_model(), uncaptured="own")


@pytest.mark.parametrize("uncaptured", ["live", "replay"])
def test_last_stats_count_drift_and_tokens_like_an_independent_reference(make_model, uncaptured):
    model = make_model()
    hook = ReplayHook(model, uncaptured=uncaptured)
    assert hook.last_stats is None
    batches = _batches(3)
    # Make the replayed routes agree with the router's own choice on some tokens,
    # so drift is neither 0 nor 1: first a forward without replay records them.
    recorder = RouteRecorder(model)
    with torch.no_grad():
        for batch in batches[:1]:
            ids = batch["input_ids"]
            model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    for layer in (0,):
        own = recorder.calls[layer][0][1].view(16, 2, -1).transpose(0, 1)  # [B, S, E]
        batches[0]["rollout_expert_indices"][:, :8, layer] = (
            own[:, :8].nonzero()[:, -1].view(2, 8, TOPK).to(torch.uint8)
        )
    recorder.clear()

    run_step(hook, model, batches)
    stats = hook.last_stats
    assert isinstance(stats, ReplayStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.microbatches = 0

    captured = sum(int((~b["router_padding_mask"]).sum()) for b in batches)
    padding = sum(int((b["attention_mask"] == 0).sum()) for b in batches)  # no real token: counted apart
    uncaptured_count = sum(int(b["router_padding_mask"].sum()) for b in batches) - padding
    live = uncaptured_count if uncaptured == "live" else 0
    assert stats.microbatches == 3
    assert stats.tokens == (captured, live, uncaptured_count - live, padding)
    assert stats.tokens.captured == captured and padding > 0
    assert stats.live_fraction == pytest.approx(live / (captured + uncaptured_count))
    assert stats.dropped_fraction is None
    assert set(stats.route_drift) == {0, 1}
    for layer, calls in recorder.calls.items():
        differ = 0
        for batch, (_, _), hidden in zip(batches, calls, recorder.inputs[layer]):
            own = own_choice(recorder.routers[layer], hidden)
            installed = expected_map(batch["rollout_expert_indices"][:, :, layer])
            captured_rows = ~_rows(batch["router_padding_mask"])
            differ += int((own != installed).any(-1)[captured_rows].sum())
        assert stats.route_drift[layer] == pytest.approx(differ / captured)
    assert 0 < stats.route_drift[0] < 1
    assert stats.mean_drift == pytest.approx(sum(stats.route_drift.values()) / 2)
    flat = stats.as_dict()
    assert flat["route_drift/layer_0"] == stats.route_drift[0]
    assert flat["live_fraction"] == stats.live_fraction and flat["tokens/captured"] == captured
    recorder.close()


def test_last_stats_is_kept_from_the_last_successful_step(make_model):
    model = make_model()
    hook = ReplayHook(model)
    run_step(hook, model, _batches(2))
    first = hook.last_stats
    bad = _batches(1)[0]
    bad["rollout_expert_indices"][0, 3, 0, 0] = 9  # a captured token
    with pytest.raises(ValueError):
        run_step(hook, model, [bad])
    assert hook.last_stats is first


def test_dropped_fraction_counts_replayed_assignments_lost_to_capacity(make_model):
    with pytest.warns(UserWarning, match="moe_expert_capacity_factor"):
        model = make_model(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")
        hook = ReplayHook(model)
    batches = _batches(2)
    recorder = RouteRecorder(model)
    run_step(hook, model, batches, forward_only=True)
    recorder.close()
    lost = total = 0
    for layer, calls in recorder.calls.items():
        for batch, (_, kept), hidden in zip(batches, calls, recorder.inputs[layer]):
            # The routes that went in: replayed where captured, the router's own choice elsewhere.
            own = own_choice(recorder.routers[layer], hidden)
            uncaptured = _rows(batch["router_padding_mask"])
            chosen = torch.where(uncaptured[:, None], own, expected_map(batch["rollout_expert_indices"][:, :, layer]))
            lost += int((chosen & ~kept).sum())
            total += int(chosen.sum())
    assert lost > 0
    assert hook.last_stats.dropped_fraction == pytest.approx(lost / total)
