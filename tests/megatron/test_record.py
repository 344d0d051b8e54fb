"""R2: record the trainer's own routes in a forward-only pass, replay them in the update."""

from __future__ import annotations

import pytest
import torch

from tests.megatron._models import EXPERTS, RouteRecorder, expected_map, make_batch, run_step
from torch_r3.megatron import ReplayHook


def _rows(mask):
    return mask.transpose(0, 1).reshape(-1)


def test_recorded_routes_replay_exactly_after_the_weights_changed(make_model):
    model = make_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    hook = ReplayHook(model)
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        b = make_batch(generator=g)
        batches.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})  # no routes
    recorder = RouteRecorder(model)
    run_step(hook, model, batches, forward_only=True, record=True)
    own = {layer: [m for _, m in calls] for layer, calls in recorder.calls.items()}  # the routers' own choice
    recorded = hook.last_recorded
    assert len(recorded) == len(batches)
    for rec, batch in zip(recorded, batches):
        assert rec["rollout_expert_indices"].shape == (2, 16, 2, 2)
        assert rec["rollout_expert_indices"].dtype == torch.uint8
        assert torch.equal(rec["router_padding_mask"], batch["attention_mask"] == 0)
    for layer, maps in own.items():
        for routing_map, rec in zip(maps, recorded):
            assert torch.equal(expected_map(rec["rollout_expert_indices"][:, :, layer]), routing_map)
    assert all(v is None for v in hook.last_stats.route_drift.values())  # nothing was replayed

    with torch.no_grad():  # the update changes the router: left alone it would route differently
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn_like(p) * 5)
    update = [{**batch, **rec} for batch, rec in zip(batches, recorded)]
    recorder.clear()
    run_step(hook, model, update)
    for layer, calls in recorder.calls.items():
        assert len(calls) == 2 * len(batches)  # forward and recompute
        for i, rec in enumerate(recorded):
            real = _rows(update[i]["attention_mask"].bool())
            want = expected_map(rec["rollout_expert_indices"][:, :, layer])
            for _, routing_map in (calls[2 * i], calls[2 * i + 1]):  # each forward, then its recompute
                assert torch.equal(routing_map[real], want[real])
    assert all(0 < v <= 1 for v in hook.last_stats.route_drift.values())  # the new weights did drift
    recorder.close()


def _ids_only_step(data_iterator, model):
    ids = next(data_iterator)["input_ids"]
    output = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None, labels=ids)
    return output, lambda out: (out.float().sum(), {})


def test_recording_is_forward_only(make_model):
    model = make_model()
    hook = ReplayHook(model)
    with pytest.raises(ValueError, match="record=True: recording routes is a forward-only pass"):
        run_step(hook, model, [make_batch()], record=True)


def test_recorded_routes_fit_the_models_expert_count(make_model):
    model = make_model()
    hook = ReplayHook(model)
    batch = make_batch()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with hook.record(num_microbatches=1):  # the context form, around Megatron's own schedule
        get_forward_backward_func()(
            forward_step_func=hook.wrap_forward_step(_ids_only_step),
            data_iterator=iter([{"input_ids": batch["input_ids"]}]),
            model=[model],
            num_microbatches=1,
            seq_length=16,
            micro_batch_size=2,
            forward_only=True,
        )
    (rec,) = hook.last_recorded
    assert int(rec["rollout_expert_indices"].max()) < EXPERTS
    assert not rec["router_padding_mask"].any()  # no attention_mask: every position is a token
