"""Routers that skip replay make the step raise; the hook's own errors for misuse during a step."""

from __future__ import annotations

import pytest
import torch

from tests.megatron._models import RouteRecorder, expected_map, forward_step, make_batch, run_step
from torch_r3.megatron import ReplayHook

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _batches(n=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [make_batch(generator=g) for _ in range(n)]


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "full-recompute"])
@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward-only"])
def test_a_router_whose_router_replay_was_removed_makes_the_step_raise_naming_its_layer(
    make_model, recompute, forward_only
):
    model = make_model(**(RECOMPUTE if recompute else {}))
    hook = ReplayHook(model)
    model.decoder.layers[1].mlp.router.router_replay = None  # routes with its own top-k from now on
    with pytest.raises(RuntimeError, match=r"layer 1: the router ran .*without consulting replay.*router_replay"):
        run_step(hook, model, _batches(), forward_only=forward_only)
    assert all(not r.replay.replay_backward_list for r in hook._routers)  # cleared on failure


def test_a_router_whose_replay_is_bypassed_only_in_recompute_makes_the_step_raise(make_model):
    model = make_model(**RECOMPUTE)
    hook = ReplayHook(model)
    router = model.decoder.layers[0].mlp.router

    def forward_then_unplug(data_iterator, m):
        out = forward_step(data_iterator, m)
        router.router_replay = None  # the forward replayed; recompute will not
        return out

    with pytest.raises(
        RuntimeError, match=r"layer 0: the router ran in activation recompute without consulting replay"
    ):
        run_step(hook, model, _batches(1), step=forward_then_unplug)


def test_quantile_balancing_is_refused_naming_the_setting(make_model):
    from tests.megatron._models import make_config

    try:
        config = make_config(moe_router_load_balancing_type="quantile_balancing")
    except (AssertionError, ValueError) as err:
        pytest.skip(f"this megatron-core has no quantile_balancing routing: {err}")
    with pytest.raises(ValueError, match="moe_router_load_balancing_type is 'quantile_balancing'"):
        ReplayHook(make_model(), config)


def test_route_drift_of_a_layer_whose_replay_never_ran_is_none_not_zero():
    from torch_r3.replay.stats import StatsCollector

    stats = StatsCollector(measure_drops=False)
    stats.add_microbatch(torch.tensor([False, False, True]), live=True)
    own = torch.tensor([[0, 1], [2, 3], [4, 5]])
    stats.add_drift(0, own, torch.tensor([[1, 0], [2, 4], [4, 5]]), torch.tensor([True, True, False]))
    result = stats.finish((0, 1))
    assert result.route_drift == {0: 0.5, 1: None}
    assert result.mean_drift == 0.5  # over the layers that replayed
    flat = result.as_dict()
    assert flat["route_drift/layer_0"] == 0.5 and flat["route_drift/layer_1"] != flat["route_drift/layer_1"]  # NaN


def test_closing_the_hook_during_a_step_raises_and_the_step_still_replays(make_model):
    model = make_model()
    hook = ReplayHook(model, uncaptured="replay")
    recorder = RouteRecorder(model)
    refused = []

    def close_midway(data_iterator, m):
        try:
            hook.close()
        except RuntimeError as err:
            refused.append(str(err))
        return forward_step(data_iterator, m)

    batches = _batches(1)
    run_step(hook, model, batches, step=close_midway, forward_only=True)
    recorder.close()
    assert refused and "close() during a step" in refused[0]
    for layer, ((_, routing_map),) in recorder.calls.items():
        assert torch.equal(routing_map, expected_map(batches[0]["rollout_expert_indices"][:, :, layer]))
    hook.close()  # after the step it closes


def test_a_forward_step_that_runs_the_model_twice_under_recompute_gets_the_hooks_error(make_model):
    model = make_model(**RECOMPUTE)
    hook = ReplayHook(model)

    def twice(data_iterator, m):
        batch = next(data_iterator)
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        first = m(ids, positions, None, labels=ids)  # e.g. two losses from two passes
        second, loss_func = forward_step(iter((batch,)), m)
        return first + second, loss_func

    with pytest.raises(RuntimeError, match=r"microbatch 0, layer 0: the model ran 2 times .*activation recompute"):
        run_step(hook, model, _batches(1), step=twice)


def test_uncaptured_replay_recompute_does_not_read_the_callers_routes_tensor(make_model):
    """int64 routes already on the model's device, one layer, one row: the hook must own its copy."""
    model = make_model(num_layers=1, **RECOMPUTE)
    hook = ReplayHook(model, uncaptured="replay")
    batch = make_batch(batch=1, layers=1, dtype=torch.int64, real=(16,), captured=(15,))
    original = batch["rollout_expert_indices"].clone()
    recorder = RouteRecorder(model)

    def refill_after_forward(data_iterator, m):
        out = forward_step(data_iterator, m)
        batch["rollout_expert_indices"].copy_((original + 3) % 8)  # the caller reuses its buffer
        return out

    run_step(hook, model, [batch], step=refill_after_forward)
    recorder.close()
    (forward, recompute) = [m for _, m in recorder.calls[0]]
    assert torch.equal(forward, expected_map(original[:, :, 0]))
    assert torch.equal(recompute, expected_map(original[:, :, 0]))
