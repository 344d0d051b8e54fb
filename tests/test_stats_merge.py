"""Expert load, `merge_stats` and `reduce_stats` (over real gloo groups) against hand-computed figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_r3.replay.stats import (
    ReplayStats,
    StatsCollector,
    StepCounts,
    TokenCounts,
    load_entropy,
    load_imbalance,
    merge_stats,
    reduce_stats,
)


def test_load_imbalance_and_entropy_by_hand():
    assert load_imbalance([2, 2, 2, 2]) == 1.0
    assert load_imbalance([8, 0, 0, 0]) == 4.0
    assert load_imbalance([3, 1, 0, 0]) == 3.0  # max 3 over mean 1
    assert load_entropy([2, 2, 2, 2]) == pytest.approx(1.0)
    assert load_entropy([8, 0, 0, 0]) == 0.0
    # shares 3/4, 1/4: -(0.75 ln 0.75 + 0.25 ln 0.25) / ln 4
    assert load_entropy([3, 1, 0, 0]) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4))
    assert math.isnan(load_imbalance([0, 0])) and math.isnan(load_entropy([0, 0]))


def _collector_step(*, num_experts):
    """Two layers, one microbatch of 4 tokens (the last uncaptured), top-2 of 4 experts."""
    c = StatsCollector(measure_drops=False, num_experts=num_experts)
    uncaptured = torch.tensor([False, False, False, True])
    c.add_microbatch(uncaptured, live=True)
    replayed = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 2]])
    own0 = torch.tensor([[1, 0], [0, 3], [1, 0], [3, 1]])  # token 1 differs (as a set); token 3 is uncaptured
    c.add_drift(0, own0, replayed, ~uncaptured)
    own1 = torch.tensor([[0, 1], [2, 0], [0, 1], [2, 3]])  # agrees everywhere
    c.add_drift(1, own1, replayed, ~uncaptured)
    return c.finish((0, 1))


def test_collector_counts_expert_load_of_the_captured_tokens_by_hand():
    stats = _collector_step(num_experts=4)
    # replayed, captured tokens 0..2: experts 0,1 / 0,2 / 1,0 -> expert 0: 3, 1: 2, 2: 1, 3: 0
    assert stats.rollout_load == {0: (3, 2, 1, 0), 1: (3, 2, 1, 0)}
    # own, layer 0: 1,0 / 0,3 / 1,0 -> 0: 3, 1: 2, 2: 0, 3: 1; layer 1 as replayed
    assert stats.trainer_load == {0: (3, 2, 0, 1), 1: (3, 2, 1, 0)}
    assert stats.route_drift == {0: pytest.approx(1 / 3), 1: 0.0}
    assert stats.counts == StepCounts(differ={0: 1, 1: 0}, captured={0: 3, 1: 3})
    flat = stats.as_dict()
    assert flat["expert_load/rollout/max_over_mean/layer_0"] == pytest.approx(3 / (6 / 4))
    shares = [3 / 6, 2 / 6, 1 / 6]
    want = -sum(p * math.log(p) for p in shares) / math.log(4)
    assert flat["expert_load/rollout/entropy/layer_1"] == pytest.approx(want)
    assert flat["expert_load/trainer/max_over_mean/layer_0"] == pytest.approx(2.0)
    assert flat["tokens/captured"] == 3 and flat["tokens/live"] == 1 and flat["live_fraction"] == 0.25


def test_expert_load_is_off_by_default_and_adds_no_names():
    stats = _collector_step(num_experts=None)
    assert stats.rollout_load is None and stats.trainer_load is None
    assert not any(name.startswith("expert_load/") for name in stats.as_dict())


def _part(differ, captured, tokens, load=None, drift_layers=None):
    layers = drift_layers or sorted(differ)
    drift = {layer: (differ[layer] / captured[layer] if layer in differ else None) for layer in layers}
    total = sum(tokens[:3])  # real tokens: padding (a fourth count) is not in the share
    return ReplayStats(
        microbatches=2,
        route_drift=drift,
        live_fraction=tokens[1] / total,
        tokens=TokenCounts(*tokens),
        counts=StepCounts({k: v for k, v in differ.items()}, dict(captured)),
        rollout_load=load,
        trainer_load=load,
    )


def test_merge_sums_counts_and_recomputes_fractions_from_the_sums():
    a = _part({0: 1, 1: 4}, {0: 10, 1: 10}, (10, 2, 0, 3), load={0: (5, 5), 1: (10, 0)})
    b = _part({0: 9}, {0: 30}, (30, 0, 6, 5), load={0: (20, 10)}, drift_layers=[0, 2])  # layer 2 never replayed
    m = merge_stats([a, b])
    assert m.microbatches == 4
    assert m.route_drift == {0: pytest.approx(10 / 40), 1: pytest.approx(4 / 10), 2: None}
    assert m.tokens == (40, 2, 6, 8)
    assert m.live_fraction == pytest.approx(2 / 48)  # padding summed apart, not in the share
    assert m.rollout_load == {0: (25, 15), 1: (10, 0)}
    assert m.as_dict()["expert_load/rollout/max_over_mean/layer_1"] == 2.0
    assert m.dropped_fraction is None


def test_merge_refuses_hand_built_and_unlike_parts():
    hand = ReplayStats(2, {0: 0.25}, 0.1, TokenCounts(90, 10, 0), None)
    with pytest.raises(ValueError, match=r"part 0 has no counts"):
        merge_stats([hand])
    with pytest.raises(ValueError, match=r"no stats to merge"):
        merge_stats([])
    loaded = _part({0: 1}, {0: 2}, (2, 0, 0), load={0: (1, 1)})
    plain = _part({0: 1}, {0: 2}, (2, 0, 0))
    with pytest.raises(ValueError, match=r"some parts measured rollout_load and some did not"):
        merge_stats([loaded, plain])
    wider = _part({0: 1}, {0: 2}, (2, 0, 0), load={0: (1, 1, 0)})
    with pytest.raises(ValueError, match=r"layer 0: expert loads of 2 and 3 experts"):
        merge_stats([loaded, wider])
    with pytest.raises(TypeError, match=r"part 1 is a dict"):
        merge_stats([loaded, {}])


def test_reduce_needs_an_initialized_process_group():
    # In a fresh interpreter: other tests of the session (the Megatron fixtures' world of one) may have
    # initialised this process's default group, which would make the refusal unobservable here.
    code = (
        "import pytest, torch.distributed as dist\n"
        "from tests.test_stats_merge import _collector_step\n"
        "from torch_r3.replay.stats import reduce_stats\n"
        "assert not dist.is_initialized()\n"
        "with pytest.raises(RuntimeError, match=r'not initialized'):\n"
        "    reduce_stats(_collector_step(num_experts=4))\n"
        "print('refused')\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr


# --- real gloo groups in spawned processes --------------------------------------------------------------


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        # Rank r measured layer r % 2 only (two pipeline stages), with its own counts.
        layer = rank % 2
        c = StatsCollector(measure_drops=False, num_experts=2)
        n = 2 + rank  # tokens on this rank, all captured
        uncaptured = torch.zeros(n, dtype=torch.bool)
        c.add_microbatch(uncaptured, live=True)
        replayed = torch.zeros(n, 1, dtype=torch.long)  # every token to expert 0
        own = torch.zeros(n, 1, dtype=torch.long)
        own[0] = 1  # one token differs
        c.add_drift(layer, own, replayed, ~uncaptured)
        stats = c.finish((layer,))
        world = reduce_stats(stats)
        pair = dist.new_group([0, 1])  # every rank creates every group
        sub = reduce_stats(stats, group=pair) if rank in (0, 1) else None
        result = {"world": world.as_dict(), "world_drift": {str(k): v for k, v in world.route_drift.items()}}
        if sub is not None:
            result["pair"] = sub.as_dict()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_reduce_stats_over_real_gloo_groups_matches_the_hand_sums(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=3, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    # ranks 0 and 2 measured layer 0 on 2 + 4 tokens, 1 differing each; rank 1 layer 1 on 3 tokens, 1 differing
    for r in got:
        assert r["world"] == got[0]["world"]  # every rank gets the same figures
    w = got[0]["world"]
    assert w["route_drift/layer_0"] == pytest.approx(2 / 6)
    assert w["route_drift/layer_1"] == pytest.approx(1 / 3)
    assert w["tokens/captured"] == 9 and w["tokens/live"] == 0
    assert w["expert_load/rollout/max_over_mean/layer_0"] == 2.0  # 6 tokens, all on expert 0 of 2
    assert w["expert_load/trainer/max_over_mean/layer_0"] == pytest.approx(4 / 3)  # (4, 2)
    assert w["expert_load/trainer/entropy/layer_1"] == pytest.approx(
        -(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3)) / math.log(2)
    )
    p = got[0]["pair"]
    assert got[1]["pair"] == p and "pair" not in got[2]
    assert (
        p["tokens/captured"] == 5
        and p["route_drift/layer_0"] == 0.5
        and p["route_drift/layer_1"] == pytest.approx(1 / 3)
    )
