"""Routes from a running vLLM replayed in the same model by `torch_r3.transformers.ReplayHook`.

The server's routes for a few requests are collated (`collate_routes`, left padding) and
replayed in the checkpoint's `transformers` model: on every captured token the routers then
choose the engine's experts, and the drift statistics, which compare the router's own top-k
with the replayed one as sets, are zero although vLLM's order inside a row is not the router's.
With one router perturbed, its own choice leaves the engine's on some tokens: replay still
forces the engine's experts, and that layer's drift is exactly the share of tokens where the
perturbed router, without replay, picks other experts.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.checkpoints import QWEN3, SPECIALS, load
from tests.engines.workload import served_rollouts
from torch_r3 import collate_routes
from torch_r3.keys import ROUTER_MASK, ROUTES
from torch_r3.transformers import ReplayHook

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PAD = SPECIALS.index("<pad>")
PERTURBED = 2  # the layer whose router the perturbation test changes


@pytest.fixture(scope="module")
def rollouts(server):
    """Four trajectories' token ids and the server's routes for them (one request each, batched)."""
    return served_rollouts(server.url, (12, 30, 75, 110), seed=20)


def batch_of(tokens, routes):
    """The collated batch (left padding) with the model inputs: token ids, attention mask, positions."""
    batch = collate_routes(routes, [len(t) for t in tokens], layout="padded")
    width = batch[ROUTES].shape[1]
    ids = torch.full((len(tokens), width), PAD, dtype=torch.long)
    for i, t in enumerate(tokens):
        ids[i, width - len(t) :] = torch.tensor(t)
    mask = batch["attention_mask"]
    assert [int(m.sum()) for m in mask] == [len(t) for t in tokens]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # each sequence's tokens count from 0, as in the engine
    return batch, {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


class RouterChoices:
    """The experts each router finally used (after any replay), per layer: `[B * T, K]`."""

    def __init__(self, model):
        self.seen = {}
        self.handles = [
            layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: self.seen.__setitem__(i, out[2].detach()))
            for i, layer in enumerate(model.model.layers)
        ]

    def per_layer(self, shape):
        return torch.stack([self.seen[i].reshape(*shape, -1) for i in range(len(self.seen))], dim=2)  # [B, T, L, K]

    def close(self):
        for h in self.handles:
            h.remove()


def captured(batch):
    """`[B, T]` True where the batch holds an engine route."""
    return ~batch[ROUTER_MASK].bool()


def test_engine_routes_replay_with_zero_drift_in_vllms_order(rollouts, checkpoints):
    tokens, routes = rollouts
    model = load(checkpoints["qwen3"])
    batch, inputs = batch_of(tokens, routes)
    hook = ReplayHook(model)
    choices = RouterChoices(model)  # registered after the hook: sees the replayed choice
    with torch.no_grad(), hook.replay(batch):
        replayed_logits = model(**inputs).logits
    used = choices.per_layer(batch[ROUTER_MASK].shape)
    replayed = batch[ROUTES].long()
    keep = captured(batch)
    assert int(keep.sum()) == sum(len(t) - 1 for t in tokens)
    # On every captured token the routers used the engine's experts, in the engine's order.
    assert torch.equal(used[keep], replayed[keep])
    stats = hook.last_stats
    assert stats.route_drift == {layer: 0.0 for layer in range(QWEN3.layers)}
    assert stats.tokens.captured == int(keep.sum())
    # ... although that order is not the router's own (descending) order on most rows:
    with torch.no_grad():
        own_logits = model(**inputs).logits  # outside replay(): the routers' own top-k
    own = choices.per_layer(batch[ROUTER_MASK].shape)
    assert torch.equal(own[keep].sort(-1).values, replayed[keep].sort(-1).values)
    assert not torch.equal(own[keep], replayed[keep])
    # The same experts in another order weight them alike: the replayed forward is the model's own.
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(replayed_logits[real], own_logits[real], rtol=1e-5, atol=1e-5)
    choices.close()
    hook.close()


def test_a_perturbed_router_drifts_without_replay_and_replays_the_engines_choice(rollouts, checkpoints):
    tokens, routes = rollouts
    model = load(checkpoints["qwen3"])
    with torch.no_grad():  # a different router in one layer: its own choice leaves the engine's
        gate = model.model.layers[PERTURBED].mlp.gate.weight
        gate.add_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(3)) * gate.std() * 0.7)
    batch, inputs = batch_of(tokens, routes)
    keep = captured(batch)
    replayed = batch[ROUTES].long()[keep]
    hook = ReplayHook(model)
    choices = RouterChoices(model)
    with torch.no_grad():
        model(**inputs)  # replay off
    own = choices.per_layer(batch[ROUTER_MASK].shape)[keep]
    differs = (own.sort(-1).values != replayed.sort(-1).values).any(-1)  # [captured tokens, L]
    assert differs[:, :PERTURBED].sum() == 0  # the layers before it still agree with the engine
    off = differs[:, PERTURBED].float().mean().item()
    assert off > 0.1
    with torch.no_grad(), hook.replay(batch):
        model(**inputs)
    used = choices.per_layer(batch[ROUTER_MASK].shape)[keep]
    assert torch.equal(used, replayed)  # replay on: the engine's experts everywhere
    drift = hook.last_stats.route_drift
    assert drift[PERTURBED] == pytest.approx(off)  # the tokens where the perturbed router would have left them
    assert all(drift[layer] == 0.0 for layer in range(PERTURBED))
    choices.close()
    hook.close()
