"""Routes from a running vLLM replayed by `torch_r3.megatron.ReplayHook` in the same model, converted to Megatron.

The Qwen3-MoE checkpoint the server runs is converted to a Megatron-core GPTModel
(`megatron_model.qwen3_megatron`, on the CPU). First, without the hook, its routers choose
the engine's experts on every captured token (the conversion is the same model). Then one
step of Megatron's schedule through the hook replays the engine's routes: the routers select
exactly them, with zero drift in vLLM's order; with one router perturbed they still select
them, and that layer's drift is the share of tokens where its own choice left them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="megatron-core is not installed")

from tests.engines.checkpoints import QWEN3, load
from tests.engines.workload import served_rollouts
from torch_r3 import collate_routes
from torch_r3.keys import ROUTER_MASK, ROUTES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PERTURBED = 1

# The Megatron suite's fixtures (a gloo world of one, Megatron on the CPU), from their one home.
_spec = importlib.util.spec_from_file_location(
    "megatron_suite_conftest", Path(__file__).resolve().parents[1] / "megatron" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
world_of_one = _suite.world_of_one
cpu_megatron = _suite.cpu_megatron


@pytest.fixture(scope="module")
def rollouts(server):
    """Three trajectories' token ids and the server's routes for them."""
    return served_rollouts(server.url, (9, 45, 90), seed=40)


def microbatches(tokens, routes):
    """One unpadded microbatch per trajectory: its collated routes and token ids."""
    out = []
    for t, r in zip(tokens, routes):
        batch = collate_routes([r], [len(t)], layout="padded")
        out.append({**batch, "input_ids": torch.tensor([t])})
    return out


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    ids = batch["input_ids"]
    logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    return logits, loss_func


def routing(recorder, batches):
    """Per layer, the `[tokens, E]` routing maps of every microbatch's captured tokens, concatenated."""
    out = {}
    for layer, calls in recorder.calls.items():
        assert len(calls) == len(batches)
        keep = [~b[ROUTER_MASK].reshape(-1) for b in batches]  # batch 1: token order is position order
        out[layer] = torch.cat([m[k] for (_, m), k in zip(calls, keep)])
    return out


def engine_maps(batches, layer):
    maps = []
    for b in batches:
        r = b[ROUTES][0, :, layer].long()[~b[ROUTER_MASK][0]]
        maps.append(torch.zeros(r.shape[0], QWEN3.num_experts, dtype=torch.bool).scatter(1, r, True))
    return torch.cat(maps)


def step(hook, model, batches):
    from tests.megatron._models import run_step

    run_step(hook, model, batches, forward_only=True, step=forward_step)


def test_megatron_replays_engine_routes_in_the_converted_model(rollouts, checkpoints, cpu_megatron):
    from tests.engines.megatron_model import qwen3_megatron
    from tests.megatron._models import RouteRecorder
    from torch_r3.megatron import ReplayHook

    tokens, routes = rollouts
    batches = microbatches(tokens, routes)
    torch.manual_seed(0)
    model = qwen3_megatron(load(checkpoints["qwen3"]))
    recorder = RouteRecorder(model)
    with torch.no_grad():  # no hook: the converted model's own routers
        for b in batches:
            model(b["input_ids"], torch.arange(b["input_ids"].shape[1]).unsqueeze(0), None)
    own = routing(recorder, batches)
    for layer in range(QWEN3.layers):
        assert torch.equal(own[layer], engine_maps(batches, layer)), (
            f"layer {layer}: the converted model routes otherwise"
        )

    hook = ReplayHook(model)
    recorder.clear()
    step(hook, model, batches)
    replayed = routing(recorder, batches)
    for layer in range(QWEN3.layers):
        assert torch.equal(replayed[layer], engine_maps(batches, layer))
    assert hook.last_stats.route_drift == {layer: 0.0 for layer in range(QWEN3.layers)}
    assert hook.last_stats.tokens.captured == sum(len(t) - 1 for t in tokens)

    with torch.no_grad():
        gate = model.decoder.layers[PERTURBED].mlp.router.weight
        gate.add_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(5)) * gate.std() * 0.7)
        recorder.clear()
        for b in batches:
            model(b["input_ids"], torch.arange(b["input_ids"].shape[1]).unsqueeze(0), None)
    off = (routing(recorder, batches)[PERTURBED] != engine_maps(batches, PERTURBED)).any(-1).float().mean().item()
    assert off > 0.1
    recorder.clear()
    step(hook, model, batches)
    replayed = routing(recorder, batches)
    for layer in range(QWEN3.layers):
        assert torch.equal(replayed[layer], engine_maps(batches, layer))
    drift = hook.last_stats.route_drift
    assert drift[PERTURBED] == pytest.approx(off)
    assert drift[0] == 0.0
    hook.close()
    recorder.close()
