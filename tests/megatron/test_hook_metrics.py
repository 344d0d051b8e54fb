"""The Megatron hook's step metrics and expert load, against an independent reference on a known batch."""

from __future__ import annotations

import pytest
import torch

from tests.megatron._models import EXPERTS, RouteRecorder, expected_map, make_batch, own_choice, run_step
from torch_r3.megatron import ReplayHook
from torch_r3.replay.stats import load_entropy, load_imbalance


def _rows(mask):
    """[B, T] -> [T*B] in the router's sequence-first token order."""
    return mask.transpose(0, 1).reshape(-1)


def test_metric_names_and_values_match_an_independent_reference_on_a_known_batch(make_model):
    model = make_model()
    hook = ReplayHook(model, expert_load=True)
    g = torch.Generator().manual_seed(11)
    batches = [make_batch(generator=g) for _ in range(2)]
    recorder = RouteRecorder(model)
    run_step(hook, model, batches)
    stats = hook.last_stats
    want = {}
    captured_total = sum(int((~b["router_padding_mask"]).sum()) for b in batches)
    uncaptured_total = sum(int(b["router_padding_mask"].sum()) for b in batches)
    drifts = []
    for layer in sorted(recorder.calls):
        differ = 0
        rollout = torch.zeros(EXPERTS, dtype=torch.long)
        trainer = torch.zeros(EXPERTS, dtype=torch.long)
        for batch, hidden in zip(batches, recorder.inputs[layer]):
            own = own_choice(recorder.routers[layer], hidden)  # [N, E] bool, by a plain reference
            installed = expected_map(batch["rollout_expert_indices"][:, :, layer])
            keep = ~_rows(batch["router_padding_mask"])
            differ += int((own != installed).any(-1)[keep].sum())
            rollout += installed[keep].sum(0)
            trainer += own[keep].sum(0)
        drifts.append(differ / captured_total)
        want[f"route_drift/layer_{layer}"] = differ / captured_total
        assert stats.rollout_load[layer] == tuple(rollout.tolist())
        assert stats.trainer_load[layer] == tuple(trainer.tolist())
        for source, load in (("rollout", rollout.tolist()), ("trainer", trainer.tolist())):
            want[f"expert_load/{source}/max_over_mean/layer_{layer}"] = load_imbalance(load)
            want[f"expert_load/{source}/entropy/layer_{layer}"] = load_entropy(load)
    recorder.close()
    want["route_drift/mean"] = sum(drifts) / len(drifts)
    # left padding (attention_mask 0) is no real token: counted apart, never live
    padding_total = sum(int((b["attention_mask"] == 0).sum()) for b in batches)
    live_total = uncaptured_total - padding_total
    want["live_fraction"] = live_total / (captured_total + live_total)
    want.update(
        {
            "tokens/captured": captured_total,
            "tokens/live": live_total,
            "tokens/filler": 0,
            "tokens/padding": padding_total,
        }
    )
    assert padding_total > 0 and live_total > 0
    got = stats.as_dict()
    assert set(got) == set(want)
    assert got == pytest.approx(want)
    assert 0 < want["route_drift/mean"]  # random routes: the router disagrees somewhere


def test_expert_load_is_off_by_default(make_model):
    model = make_model()
    hook = ReplayHook(model)
    g = torch.Generator().manual_seed(3)
    run_step(hook, model, [make_batch(generator=g)], forward_only=True)
    assert hook.last_stats.rollout_load is None
    assert hook.last_stats.counts is not None
    with pytest.raises(TypeError, match=r"expert_load: expected True or False"):
        ReplayHook(make_model(), expert_load="yes")


@pytest.mark.parametrize("uncaptured", ["live", "replay"])
def test_live_fraction_is_the_share_of_real_tokens_without_a_route_and_padding_is_counted_apart(make_model, uncaptured):
    # The controlled case: one uncaptured real token per trajectory (two per microbatch), for
    # two 10-token trajectories and for a 10-token and a 2-token one; the 8 positions of left
    # padding in the second are no real token and are counted on their own.
    from torch_r3.replay.stats import TokenCounts

    model = make_model()
    hook = ReplayHook(model, uncaptured=uncaptured)
    for real, padding in (((10, 2), 8), ((10, 10), 0)):
        batch = make_batch(seq_len=10, real=real, captured=(real[0] - 1, real[1] - 1))
        run_step(hook, model, [batch])
        live = 2 if uncaptured == "live" else 0
        assert hook.last_stats.live_fraction == pytest.approx(live / sum(real)), real
        assert hook.last_stats.tokens == TokenCounts(sum(real) - 2, live, 2 - live, padding), real
