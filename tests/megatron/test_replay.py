"""ReplayHook on a tiny MoE GPTModel, one process (gloo, world size 1, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.megatron._models import TOPK, RouteRecorder, expected_map, forward_step, make_batch, run_step
from torch_r3.megatron import InterleavedPipelineError, ReplayHook


def _real_rows_match(routing_map, routes, mask):
    """Per real (captured) token: selected expert set == installed route set."""
    want = expected_map(routes)
    real = (~mask).transpose(0, 1).reshape(-1)
    return bool((routing_map[real] == want[real]).all())


def test_routers_select_exactly_the_installed_routes_even_after_perturbing_weights(make_model):
    model = make_model()
    hook = ReplayHook(model)
    batch = make_batch(dtype=torch.uint8)
    recorder = RouteRecorder(model)
    run_step(hook, model, [batch], forward_only=True)
    for layer, calls in recorder.calls.items():
        ((action, routing_map),) = calls
        assert _real_rows_match(routing_map, batch["rollout_expert_indices"][:, :, layer], batch["router_padding_mask"])

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn_like(p) * 5)
    for calls in recorder.calls.values():
        calls.clear()
    run_step(hook, model, [batch])
    for layer, calls in recorder.calls.items():
        assert calls, "router never ran"
        for _, routing_map in calls:
            assert _real_rows_match(
                routing_map, batch["rollout_expert_indices"][:, :, layer], batch["router_padding_mask"]
            )
    recorder.close()


def test_without_the_hook_the_router_picks_its_own_experts(make_model):
    model = make_model()
    batch = make_batch()
    recorder = RouteRecorder(model)
    ids = batch["input_ids"]
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    recorder.close()
    for layer, ((action, routing_map),) in recorder.calls.items():
        assert action is None
        assert not _real_rows_match(
            routing_map, batch["rollout_expert_indices"][:, :, layer], batch["router_padding_mask"]
        )


def test_full_recompute_drains_every_fifo_with_the_matching_microbatch(make_model):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    model = make_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    hook = ReplayHook(model, uncaptured="replay")  # every row, filler included, comes from the FIFO
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(generator=g, dtype=torch.int16) for _ in range(3)]
    recorder = RouteRecorder(model)
    assert sorted(recorder.calls) == list(hook.layers) == [0, 1]  # the recorder sees every MoE router
    for _ in range(2):  # two steps: nothing stale carries over
        recorder.clear()
        run_step(hook, model, batches)
        for r in hook._routers:
            assert r.replay.replay_backward_list == []
            assert r.pushes == 0 and r.replay.router_replay_action is None
        for layer, calls in recorder.calls.items():
            # Each microbatch routes twice per layer: its forward, then its recompute in backward.
            actions = [action for action, _ in calls]
            assert actions.count(RouterReplayAction.REPLAY_FORWARD) == len(batches), actions
            assert actions.count(RouterReplayAction.REPLAY_BACKWARD) == len(batches), actions
            assert len(actions) == 2 * len(batches), actions
            for action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
                maps = [m for a, m in calls if a == action]
                for routing_map, batch in zip(maps, batches, strict=True):
                    # padding routes are replayed too: every row matches, in microbatch order
                    want = expected_map(batch["rollout_expert_indices"][:, :, layer])
                    assert torch.equal(routing_map, want), (layer, action)
    recorder.close()


def test_a_fifo_that_is_not_drained_exactly_raises(make_model):
    model = make_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    hook = ReplayHook(model)
    router = hook._routers[0]

    def pushes_one_more(data_iterator, model):
        out = forward_step(data_iterator, model)
        router.replay.replay_backward_list.append(router.replay.replay_backward_list[-1])
        return out

    with pytest.raises(RuntimeError, match=r"layer 0: 2 routes left in the backward FIFO after 2 forwards, expected 0"):
        hook.forward_backward(
            forward_step_func=pushes_one_more,
            data_iterator=iter([make_batch(), make_batch()]),
            model=[model],
            num_microbatches=2,
            seq_length=16,
            micro_batch_size=2,
        )
    assert router.replay.replay_backward_list == []  # cleared even on failure


def test_dense_first_layers_map_to_their_global_layer_in_either_routes_layout(make_model):
    model = make_model(num_layers=3, moe_layer_freq=[0, 1, 1])
    hook = ReplayHook(model, uncaptured="replay")  # compare every row
    assert hook.layers == (1, 2)
    recorder = RouteRecorder(model)
    for layers, offset in ((3, 0), (2, -1)):  # every layer / MoE layers only
        batch = make_batch(layers=layers)
        for calls in recorder.calls.values():
            calls.clear()
        run_step(hook, model, [batch], forward_only=True)
        for layer, ((_, routing_map),) in recorder.calls.items():
            want = batch["rollout_expert_indices"][:, :, layer + offset]
            assert torch.equal(routing_map, expected_map(want))
    with pytest.raises(ValueError, match="rollout_expert_indices has 4 layers; expected num_layers = 3 .* or 2"):
        run_step(hook, model, [make_batch(layers=4)], forward_only=True)
    recorder.close()


def test_route_layers_takes_numpy_integers_and_refuses_what_is_no_layer(make_model):
    """`route_layers=` follows the package's rule for index sequences: NumPy integers and arrays are ints."""
    import numpy as np

    model = make_model(num_layers=3, moe_layer_freq=[0, 1, 1])
    recorder = RouteRecorder(model)
    for route_layers in ([np.int64(1), np.int64(2)], np.array([2, 1])):
        hook = ReplayHook(model, uncaptured="replay", route_layers=route_layers)
        batch = make_batch(layers=2)
        for calls in recorder.calls.values():
            calls.clear()
        run_step(hook, model, [batch], forward_only=True)
        held = [int(layer) for layer in route_layers]
        for layer, ((_, routing_map),) in recorder.calls.items():
            want = batch["rollout_expert_indices"][:, :, held.index(layer)]
            assert torch.equal(routing_map, expected_map(want))
        hook.close()
    for bad, error, message in (
        ([1, True], TypeError, r"route_layers\[1\] must be an int, got bool"),
        ([1, 3], ValueError, r"route_layers\[1\]: layer 3 is outside \[0, 3\)"),
        ([2, 2], ValueError, r"route_layers\[1\]: layer 2 is listed twice"),
        ("12", TypeError, r"route_layers must be a sequence of ints, got str"),
    ):
        with pytest.raises(error, match=message):
            ReplayHook(model, route_layers=bad)
    recorder.close()


def test_model_gets_the_true_padding_mask_and_the_routers_gather_with_int64(make_model):
    model = make_model()
    hook = ReplayHook(model)
    seen = {}

    def capture(module, args, kwargs):
        seen["padding_mask"] = kwargs.get("padding_mask")
        seen["targets"] = [r.replay.target_topk_idx for r in hook._routers]

    def used(module, args, output):  # what each router gathered and dispatched with, after the forward
        seen["used"] = [r.current.indices for r in hook._routers]

    handle = model.register_forward_pre_hook(capture, with_kwargs=True)
    after = model.register_forward_hook(used)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        batch = make_batch(dtype=dtype, padding="arange")
        run_step(hook, model, [batch], forward_only=True)
        # Megatron's padding_mask marks left padding only; real uncaptured tokens count as tokens.
        assert torch.equal(seen["padding_mask"], batch["attention_mask"] == 0)
        assert not torch.equal(seen["padding_mask"], batch["router_padding_mask"])
        # Installed in the batch's dtype (uncaptured="live": the router call widens them as it merges
        # in its own choice); the routers gather and scatter with int64.
        assert all(t.dtype == dtype and t.shape == (32, TOPK) for t in seen["targets"])
        assert all(t.dtype == torch.int64 and t.shape == (32, TOPK) for t in seen["used"])
        # Without attention_mask, padding is each row's leading run of uncaptured positions.
        del batch["attention_mask"]
        run_step(hook, model, [batch], forward_only=True, step=_forward_without_attention_mask)
        assert torch.equal(seen["padding_mask"], _leading_true(batch["router_padding_mask"]))
    handle.remove()
    after.remove()
    hook.close()


def _leading_true(mask):
    out = torch.zeros_like(mask)
    for i, row in enumerate(mask.tolist()):
        for t, value in enumerate(row):
            if not value:
                break
            out[i, t] = True
    return out


def _forward_without_attention_mask(data_iterator, model):
    batch = next(data_iterator)
    ids = batch["input_ids"]
    output = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None, labels=ids)
    return output, lambda out: (out.float().sum(), {})


def test_closing_the_hook_stops_handing_the_padding_mask(make_model):
    model = make_model()
    seen = []
    batch = make_batch(padding="arange")
    with ReplayHook(model) as hook:
        # Registered after the hook's own pre-hook, so it sees what the model gets.
        handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("padding_mask")), with_kwargs=True)
        run_step(hook, model, [batch], forward_only=True)
    assert torch.equal(seen[-1], batch["attention_mask"] == 0)
    # Closed: the model runs as if the hook never existed, with no stale targets.
    model(batch["input_ids"], torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]), None)
    assert seen[-1] is None
    assert all(r.replay.target_topk_idx is None and not r.replay.replay_backward_list for r in hook._routers)
    handle.remove()


def test_only_this_models_routers_are_touched_not_orphans(make_model):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    orphan = make_model()
    model = make_model()
    assert len(RouterReplay.global_router_replay_instances) >= 4
    hook = ReplayHook(model)
    seen = []

    def capture(data_iterator, m):
        out = forward_step(data_iterator, m)
        seen.append([len(r.router_replay.replay_backward_list) for r in _routers(orphan)])
        return out

    hook.forward_backward(
        forward_step_func=capture,
        data_iterator=iter([make_batch()]),
        model=[model],
        num_microbatches=1,
        seq_length=16,
        micro_batch_size=2,
        forward_only=True,
    )
    assert seen == [[0, 0]]


def _routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


# ------------------------------------------------------------------- refusals


def test_refuses_vpp_from_config(make_model):
    model = make_model()
    config = dataclasses.replace(
        model.config, virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4
    )
    with pytest.raises(
        InterleavedPipelineError,
        match=r"virtual_pipeline_model_parallel_size=2: .*FIFO.*virtual_pipeline_model_parallel_size=None or 1",
    ):
        ReplayHook(model, config)


def test_refuses_more_than_one_model_chunk(make_model):
    with pytest.raises(InterleavedPipelineError, match="got 2 model chunks.*interleaved"):
        ReplayHook([make_model(), make_model()])


def test_accepts_a_list_of_one_chunk_and_vpp_one_and_replays_on_it(make_model):
    """A one-chunk list with `virtual_pipeline_model_parallel_size=1` is no interleaving: the hook replays."""
    model = make_model()
    config = dataclasses.replace(model.config, virtual_pipeline_model_parallel_size=1)
    batch = make_batch()
    recorder = RouteRecorder(model)
    with ReplayHook([model], config) as hook:
        assert hook.layers == (0, 1)
        run_step(hook, model, [batch], forward_only=True)
    assert sorted(recorder.calls) == [0, 1]
    for layer, ((_, routing_map),) in recorder.calls.items():
        assert _real_rows_match(routing_map, batch["rollout_expert_indices"][:, :, layer], batch["router_padding_mask"])
    recorder.close()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("moe_enable_routing_replay", False, "config.moe_enable_routing_replay is False"),
        ("moe_router_fusion", True, "config.moe_router_fusion is True: .*bypasses replay"),
        ("moe_router_load_balancing_type", "sinkhorn", "moe_router_load_balancing_type is 'sinkhorn'"),
    ],
)
def test_refuses_configs_that_bypass_replay(make_model, field, value, message):
    model = make_model()
    config = dataclasses.replace(model.config)
    object.__setattr__(config, field, value)
    with pytest.raises(ValueError, match=message):
        ReplayHook(model, config)


def test_refuses_a_model_without_router_replay(make_model):
    dense = make_model(num_moe_experts=None, moe_enable_routing_replay=False)
    with pytest.raises(ValueError, match="model: no MoE router with a RouterReplay instance"):
        ReplayHook(dense, make_model().config)


def test_refuses_non_modules():
    with pytest.raises(TypeError, match=r"model\[0\]: expected a torch.nn.Module, got str"):
        ReplayHook(["not a model"])


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda b: b.pop("rollout_expert_indices"), ValueError, "missing key 'rollout_expert_indices'"),
        (
            lambda b: b.update(rollout_expert_indices=b["rollout_expert_indices"].float()),
            TypeError,
            "rollout_expert_indices: expected a uint8/int16/int32/int64",
        ),
        (
            lambda b: b.update(router_padding_mask=b["router_padding_mask"].long()),
            TypeError,
            "router_padding_mask: expected a torch.bool tensor, got torch.int64",
        ),
        (
            lambda b: b.update(rollout_expert_indices=b["rollout_expert_indices"][..., :1]),
            ValueError,
            r"rollout_expert_indices: expected \[B, T, L, K=2\]",
        ),
        (
            lambda b: b.update(router_padding_mask=b["router_padding_mask"][:, 1:]),
            ValueError,
            r"router_padding_mask: expected \[B, T\] = \[2, 16\], got \[2, 15\]",
        ),
    ],
)
def test_refuses_bad_microbatches_before_installing(make_model, change, error, message):
    model = make_model()
    hook = ReplayHook(model)
    batch = make_batch()
    change(batch)
    with pytest.raises(error, match=message):
        run_step(hook, model, [batch], forward_only=True)
    assert all(r.replay.replay_backward_list == [] for r in hook._routers)


def test_forward_step_outside_a_step_is_refused(make_model):
    model = make_model()
    hook = ReplayHook(model)
    with pytest.raises(RuntimeError, match=r"outside ReplayHook.step\(\)"):
        hook.wrap_forward_step(forward_step)(iter([make_batch()]), model)


def test_packed_layout_replays_in_token_order(make_model):
    model = make_model()
    hook = ReplayHook(model, uncaptured="replay")  # compare every row
    padded = make_batch(batch=1, real=(16,), captured=(12,))
    batch = {
        "rollout_expert_indices": padded["rollout_expert_indices"][0],
        "router_padding_mask": padded["router_padding_mask"][0],
        "cu_seqlens": torch.tensor([0, 7, 16], dtype=torch.int32),
        "input_ids": padded["input_ids"],
        "attention_mask": padded["attention_mask"],
    }
    recorder = RouteRecorder(model)
    run_step(hook, model, [batch], forward_only=True)
    recorder.close()
    for layer, ((_, routing_map),) in recorder.calls.items():
        assert torch.equal(routing_map, expected_map(padded["rollout_expert_indices"][:, :, layer]))


def test_a_second_hook_on_the_same_model_is_refused_until_the_first_closes(make_model):
    model = make_model()
    first = ReplayHook(model)
    with pytest.raises(ValueError, match="already belongs to an open ReplayHook"):
        ReplayHook(model)
    run_step(first, model, [make_batch()], forward_only=True)  # the first is unharmed
    first.close()
    ReplayHook(model).close()
