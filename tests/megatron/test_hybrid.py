"""HybridModel (megatron-core 0.18+): MoE layers from the hybrid layer pattern, exact replay."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.megatron._models import RouteRecorder, build_hybrid_model, expected_map, make_batch, run_step
from torch_r3.megatron import ReplayHook, hybrid_moe_pattern

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core.models.hybrid") is None,
    reason="this megatron-core has no HybridModel (added in 0.18 as the rename of MambaModel)",
)


def test_hybrid_pattern_marks_the_moe_layers():
    assert hybrid_moe_pattern("*E*E") == (False, True, False, True)
    assert hybrid_moe_pattern("E*|-E/*E") == (True, False, False, True)  # stages joined, MTP part dropped
    with pytest.raises(ValueError, match="has no decoder layer"):
        hybrid_moe_pattern("/*E")


@pytest.mark.parametrize("layers, offset", [(4, 0), (2, None)], ids=["every-layer", "moe-only"])
def test_hybrid_model_replays_exactly_and_maps_layers_from_its_pattern(cpu_megatron, layers, offset):
    torch.manual_seed(0)
    model = build_hybrid_model("*E*E", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    hook = ReplayHook(model, uncaptured="replay")  # every row comes from the routes
    assert hook.layers == (1, 3)  # the routers of the 'E' layers, not moe_layer_freq's guess
    recorder = RouteRecorder(model)
    g = torch.Generator().manual_seed(2)
    batches = [make_batch(generator=g, layers=layers) for _ in range(2)]
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("padding_mask")), with_kwargs=True)
    run_step(hook, model, batches)
    handle.remove()
    recorder.close()
    for i, batch in enumerate(batches):
        assert torch.equal(seen[i], batch["attention_mask"] == 0)
    for j, layer in enumerate(hook.layers):
        index = layer if offset == 0 else j
        calls = recorder.calls[layer]
        assert len(calls) == 2 * len(batches)  # forward, then recompute, per microbatch
        for i, batch in enumerate(batches):
            want = expected_map(batch["rollout_expert_indices"][:, :, index])
            assert torch.equal(calls[2 * i][1], want) and torch.equal(calls[2 * i + 1][1], want)
    hook.close()


def test_hybrid_model_under_pipeline_parallelism_is_refused_by_name(cpu_megatron):
    import dataclasses

    torch.manual_seed(0)
    model = build_hybrid_model("*E*E")
    config = dataclasses.replace(model.config)
    object.__setattr__(config, "pipeline_model_parallel_size", 2)
    with pytest.raises(ValueError, match="HybridModel with pipeline_model_parallel_size=2"):
        ReplayHook(model, config)


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_under_sequence_parallelism_the_hook_cuts_padding_mask_only_for_models_that_do_not(cpu_megatron, kind):
    """GPTModel scatters padding_mask for SP on its own; HybridModel hands it to its layers as given.

    This rank's place is set to TP rank 1 of 2 with sequence parallelism (one process cannot
    run TP=2): what the model is handed and what each router is given are compared with
    the rank's share, built position by position.
    """
    from tests.megatron._models import build_model
    from torch_r3.megatron import RankSlice

    torch.manual_seed(0)
    model = build_model() if kind == "gpt" else build_hybrid_model("E*E*")
    hook = ReplayHook(model)
    hook._rank = lambda: RankSlice(tp_size=2, tp_rank=1, sequence_parallel=True)
    batch = make_batch()
    with hook.step(forward_only=True):
        hook.begin_microbatch(batch)
        handed = hook._active_mask
        targets = [r.current for r in hook._routers]
    padding = batch["attention_mask"] == 0
    share = slice(8, 16)  # TP rank 1's half of 16 positions
    want_model = padding if kind == "gpt" else padding[:, share]
    assert torch.equal(handed, want_model)
    want_router = torch.tensor([bool(batch["router_padding_mask"][b, s]) for s in range(8, 16) for b in range(2)])
    for j, target in enumerate(targets):
        assert torch.equal(target.uncaptured, want_router)
        routes = batch["rollout_expert_indices"][:, share, j].long()
        assert torch.equal(target.indices, routes.transpose(0, 1).reshape(-1, routes.shape[-1]))
