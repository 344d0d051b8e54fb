"""The transformers hook's step metrics and expert load, against counts made by hand from the batch."""

from __future__ import annotations

import pytest
import torch

from tests.transformers.hf_models import build, inputs, make_batch
from torch_r3.keys import ROUTER_MASK, ROUTES
from torch_r3.replay.stats import load_entropy, load_imbalance, merge_stats
from torch_r3.transformers import ReplayHook


@pytest.fixture(scope="module")
def qwen():
    return build("qwen3_moe")


def _load(routes: torch.Tensor, captured: torch.Tensor, num_experts: int) -> tuple[int, ...]:
    """Tokens per expert over the captured positions, counted one by one."""
    counts = [0] * num_experts
    for ids, keep in zip(routes.reshape(-1, routes.shape[-1]).tolist(), captured.reshape(-1).tolist()):
        if keep:
            for e in ids:
                counts[e] += 1
    return tuple(counts)


def test_metric_names_and_values_match_a_hand_count_on_a_known_batch(qwen):
    with ReplayHook(qwen, expert_load=True) as hook:
        batch = make_batch(hook)
        with torch.no_grad(), hook.record() as rec:
            qwen(**inputs(batch))
        own = rec.batch[ROUTES]
        routes = own.clone()
        last = hook.layers[-1]
        # Only the last layer's routes change, so every router's input (and own choice) is the recorded one.
        routes[0, 1:5, last] = (routes[0, 1:5, last] + 1) % hook.num_experts
        mask = batch[ROUTER_MASK]
        with torch.no_grad(), hook.replay({ROUTES: routes, ROUTER_MASK: mask}):
            qwen(**inputs(batch))
        stats = hook.last_stats
    captured = ~mask
    n = int(captured.sum())
    differ = int(((routes[..., last, :].sort(-1).values != own[..., last, :].sort(-1).values).any(-1) & captured).sum())
    want = {}
    for layer in hook.layers:
        want[f"route_drift/layer_{layer}"] = differ / n if layer == last else 0.0
    want["route_drift/mean"] = differ / n / len(hook.layers)
    padding = batch["attention_mask"] == 0  # left padding: no real token, counted apart
    live = int((mask & ~padding).sum())
    want["live_fraction"] = live / int((~padding).sum())
    want.update({"tokens/captured": n, "tokens/live": live, "tokens/filler": 0, "tokens/padding": int(padding.sum())})
    for layer in hook.layers:
        rollout = _load(routes[..., layer, :], captured, hook.num_experts)
        trainer = _load(own[..., layer, :], captured, hook.num_experts)
        assert stats.rollout_load[layer] == rollout and stats.trainer_load[layer] == trainer
        for source, load in (("rollout", rollout), ("trainer", trainer)):
            want[f"expert_load/{source}/max_over_mean/layer_{layer}"] = load_imbalance(load)
            want[f"expert_load/{source}/entropy/layer_{layer}"] = load_entropy(load)
    got = stats.as_dict()
    assert set(got) == set(want)
    assert got == pytest.approx(want)
    assert differ > 0
    assert stats.rollout_load[last] != stats.trainer_load[last]
    # merging the step with itself doubles the counts and keeps every fraction
    twice = merge_stats([stats, stats])
    assert twice.tokens == tuple(2 * t for t in stats.tokens)
    assert twice.as_dict()["route_drift/mean"] == pytest.approx(got["route_drift/mean"])


def test_expert_load_must_be_a_bool(qwen):
    with pytest.raises(TypeError, match=r"expert_load: expected True or False, got 1"):
        ReplayHook(qwen, expert_load=1)
    with ReplayHook(qwen, expert_load=True):  # the refused hook claimed no router
        pass


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_live_fraction_is_the_share_of_real_tokens_without_a_route_and_padding_is_counted_apart(qwen, layout):
    # The controlled case: one uncaptured real token (the last sampled one) per trajectory, so
    # two per batch, for two 10-token trajectories and for a 10-token and a 2-token one. Left
    # padding (8 positions in the second batch) is no real token: counted on its own.
    from torch_r3.replay.stats import TokenCounts

    for lengths in ((10, 2), (10, 10)):
        with ReplayHook(qwen) as hook:
            batch = make_batch(hook, lengths=lengths, layout=layout)
            if layout == "packed":
                bounds = batch["cu_seqlens"].tolist()
                positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
                args = {"input_ids": batch["input_ids"][None], "position_ids": positions}
            else:
                args = inputs(batch)
            with torch.no_grad(), hook.replay(batch):
                qwen(**args)
            stats = hook.last_stats
        real = sum(lengths)
        padding = len(lengths) * max(lengths) - real if layout == "padded" else 0
        assert stats.live_fraction == pytest.approx(2 / real), lengths
        assert stats.tokens == TokenCounts(captured=real - 2, live=2, filler=0, padding=padding), lengths
        assert stats.as_dict()["tokens/padding"] == padding


def test_with_filler_routes_padding_is_still_no_filler_token(qwen):
    from torch_r3.replay.stats import TokenCounts

    with ReplayHook(qwen, uncaptured="replay") as hook:
        batch = make_batch(hook, lengths=(10, 2))
        with torch.no_grad(), hook.replay(batch):
            qwen(**inputs(batch))
        assert hook.last_stats.tokens == TokenCounts(captured=10, live=0, filler=2, padding=8)
        assert hook.last_stats.live_fraction == 0.0
