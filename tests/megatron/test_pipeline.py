"""Two processes (gloo), pipeline size 2: exact replay without VPP; why VPP is refused.

Both scenarios share one spawn (process start-up dominates the runtime).
"""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from tests.megatron import _pp_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_pp_worker.run, args=(2, port, str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_pp2_full_recompute_replays_each_microbatch_exactly_on_both_stages(pp_results):
    assert [r["pp_layers"] for r in pp_results] == [[0, 1], [2, 3]]
    for r in pp_results:
        assert r["pp_checked"] == 2 * _pp_worker.M  # 2 routers x 4 microbatches per stage
        assert r["pp_wrong"] == 0
        assert r["pp_drained"]


def test_pp2_stage_only_routes_replay_exactly_and_a_wrong_layer_map_is_refused(pp_results):
    for r in pp_results:
        stage = r["pp_layers"]
        for name in ("stage_only", "route_layers"):
            assert r[f"{name}_checked"] == 2 * _pp_worker.M
            assert r[f"{name}_wrong"] == 0
        other = [layer for layer in range(4) if layer not in stage]
        assert f"route_layers={other} does not hold layer {stage[0]}" in r["wrong_map"]
        assert "rollout_expert_indices has 3 layers" in r["wrong_width"]
        assert f"or 2 (this pipeline stage's MoE layers {stage} only)" in r["wrong_width"]


def test_vpp2_is_refused_before_any_step(pp_results):
    for r in pp_results:
        chunk_list, one_chunk = r["vpp_refusals"]
        assert "virtual_pipeline_model_parallel_size=2" in chunk_list
        assert "FIFO" in chunk_list and "non-interleaved 1F1B" in chunk_list
        assert "virtual pipeline size is 2" in one_chunk


def test_naive_push_to_every_router_under_vpp_recomputes_other_microbatches_routes(pp_results):
    checked = sum(r["naive_checked"] for r in pp_results)
    wrong = sum(r["naive_wrong"] for r in pp_results)
    assert checked == 2 * 2 * _pp_worker.M  # 2 stages x 2 chunks x 1 router x 4 microbatches
    assert wrong > 0
