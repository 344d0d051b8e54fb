"""Replay across ranks (data, tensor + sequence, pipeline, context parallel) vs one process.

Each layout runs in spawned processes on ``torch.distributed``: every rank reads
its share of eight trajectories through a ``DataLoader`` with
``DistributedSampler`` and ``R3Collator`` and replays with its own
``ReplayHook``. In the same spawn, global rank 0 runs the same samples through
the same weights in a single process with no parallelism (the reference; see
``_mr_worker``). The checks, per rank:

* every router row (a token of a microbatch, in one layer) selects exactly the
  reference's experts for that sample and position, and every captured row
  selects exactly the routes the trajectory carries; recompute replays each
  microbatch's rows again in order;
* every position of every sample is routed once per layer across the ranks
  that split the sequence;
* the per-token losses and the gradients (gathered over tensor-parallel
  shards, summed over data-parallel ranks, as a data-parallel all-reduce would)
  equal the reference's up to float rounding: batch composition and all-reduce
  order change the summation order, nothing else.

On the CPU the processes use gloo, which has every collective these layouts
call. Tensor parallelism with sequence parallelism builds its norms with a plain
LayerNorm tagged for sequence parallelism (``_mr_worker.SequenceParallelLayerNorm``):
without Apex or Transformer Engine, Megatron's ``WrappedTorchNorm`` asserts
``sequence_parallel`` is off. Context parallelism and the packed (THD) layout
need Transformer Engine's attention and run only on GPUs (NCCL); see
``tests/gpu/multirank_nccl.sh``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections import defaultdict

import pytest
import torch
import torch.multiprocessing as mp

from tests.megatron import _mr_worker
from tests.megatron._mr_worker import NUM_SAMPLES, SCENARIOS, SEQ, make_samples

pytestmark = pytest.mark.slow

BACKEND = os.environ.get("TORCH_R3_TEST_BACKEND", "gloo")  # tests/gpu/multirank_nccl.sh sets "nccl"

_CP_ON_CPU = (
    "context parallelism and the packed (THD) layout need Transformer Engine's attention, "
    "which needs CUDA: megatron.core.transformer.dot_product_attention.DotProductAttention."
    "__init__ asserts context_parallel_size == 1 ('Context parallelism is only supported by "
    "TEDotProductAttention!') and its forward asserts packed_seq_params is None; run "
    "tests/gpu/multirank_nccl.sh on a machine with 2 GPUs"
)


def _gpu_ready(world_size: int) -> bool:
    if BACKEND != "nccl" or torch.cuda.device_count() < world_size:
        return False
    return importlib.util.find_spec("transformer_engine") is not None


def _spawn(out_dir, world_size: int, names: list[str]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Fresh processes (no inherited process group or threads) forked from one
    # server that has imported torch and Megatron once: start-up is what costs.
    mp.get_context("forkserver").set_forkserver_preload(["tests.megatron._mr_worker", *_mr_worker.PRELOAD])
    mp.start_processes(
        _mr_worker.run,
        args=(world_size, port, str(out_dir), names, BACKEND),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )
    return {
        name: (
            torch.load(out_dir / f"{name}.reference.pt"),
            [torch.load(out_dir / f"{name}.rank{r}.pt") for r in range(world_size)],
        )
        for name in names
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Data parallel 2, then tensor parallel 2 with sequence parallelism, in one spawn."""
    if BACKEND == "nccl" and not _gpu_ready(2):
        pytest.skip("TORCH_R3_TEST_BACKEND=nccl needs 2 GPUs and Transformer Engine")
    return _spawn(tmp_path_factory.mktemp("mr2"), 2, ["dp2", "tp2_sp"])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Pipeline 2 x data parallel 2 with full activation recompute."""
    if BACKEND == "nccl" and not _gpu_ready(4):
        pytest.skip("TORCH_R3_TEST_BACKEND=nccl needs 4 GPUs and Transformer Engine for this layout")
    return _spawn(tmp_path_factory.mktemp("mr4"), 4, ["pp2_dp2_recompute"])


@pytest.fixture(scope="module")
def context_parallel(tmp_path_factory):
    """Context parallel 2, padded and packed (THD): GPUs with NCCL only."""
    if not _gpu_ready(2):
        pytest.skip(_CP_ON_CPU)
    return _spawn(tmp_path_factory.mktemp("cp2"), 2, ["cp2_padded", "cp2_thd"])


# --------------------------------------------------------------------- checks


def _captured(samples, packed: bool) -> dict:
    """(sample, position) -> [L, K] routes, for every position that has a captured route."""
    routes = {}
    for s in samples:
        n = len(s["input_ids"])
        start = 0 if packed else SEQ - n  # left padding in the padded layout
        for j in range(n - 1):
            routes[(s["sample_id"], start + j)] = torch.as_tensor(s["routes"][j]).long()
    return routes


def _rows(result: dict, phase: str) -> dict:
    """(layer, sample, position) -> list of routing-map rows, in call order."""
    rows = defaultdict(list)
    for layer, maps in result[phase].items():
        for keys, routing_map in zip(result["row_keys"], maps):
            assert routing_map.shape[0] == keys.shape[0]
            for (sample, position), row in zip(keys.tolist(), routing_map):
                rows[(layer, sample, position)].append(row)
    return rows


def _losses(result: dict) -> dict:
    return {
        tuple(k): v
        for keys, values in zip(result["loss_keys"], result["losses"])
        for k, v in zip(keys.tolist(), values)
    }


def _check(results, name: str, *, layers_per_stage) -> None:
    scenario = SCENARIOS[name]
    ref, ranks = results[name]
    samples = make_samples()
    captured = _captured(samples, scenario.packed)
    ref_rows = {k: v[0] for k, v in _rows(ref, "forward").items()}
    ref_losses = _losses(ref)
    # On GPUs the models run in bf16 (Transformer Engine's attention): looser, and a
    # near tie of a token routed live (no captured route) may flip between layouts.
    tolerance = dict(rtol=1e-4, atol=1e-5) if BACKEND == "gloo" else dict(rtol=5e-2, atol=5e-2)
    exact_live = BACKEND == "gloo"

    # The sampler gives each data-parallel replica its own samples; all ranks of a
    # replica (pipeline stages, tensor/context-parallel peers) read the same ones.
    by_replica = defaultdict(set)
    for r in ranks:
        ids = [i for mb in r["sample_ids"] for i in mb]
        by_replica[r["ranks"]["dp"]].add(tuple(ids))
    assert all(len(v) == 1 for v in by_replica.values())
    seen = [i for v in by_replica.values() for i in next(iter(v))]
    assert sorted(seen) == list(range(NUM_SAMPLES))

    routed = defaultdict(int)
    for r in ranks:
        assert r["layers"] == layers_per_stage[r["ranks"]["pp"]]
        forward = _rows(r, "forward")
        assert {k[0] for k in forward} == set(r["layers"])
        for (layer, sample, position), rows in forward.items():
            assert len(rows) == 1, f"rank {r['ranks']}: layer {layer} routed ({sample}, {position}) twice"
            row, where = rows[0], (r["ranks"], layer, sample, position)
            if (sample, position) in captured:
                want = torch.zeros_like(row).scatter(0, captured[(sample, position)][layer], True)
                assert torch.equal(row, want), where
            if exact_live or (sample, position) in captured:
                assert torch.equal(row, ref_rows[(layer, sample, position)]), where
            routed[(layer, sample, position)] += 1
        if scenario.recompute:
            for layer in r["layers"]:
                assert len(r["recompute"][layer]) == len(r["sample_ids"])
                for again, first in zip(r["recompute"][layer], r["forward"][layer]):
                    assert torch.equal(again, first)
        for key, value in _losses(r).items():
            torch.testing.assert_close(value, ref_losses[key], **tolerance)
        for param, grad in r["grads"].items():
            want = ref["grads"][param].float()
            scale = float(want.abs().max()) or 1.0
            # B023: assert_close calls `msg` before it returns, while `param` is this iteration's.
            torch.testing.assert_close(grad.float() / scale, want / scale, **tolerance, msg=lambda m: f"{param}: {m}")  # noqa: B023

    # hook.last_stats counts this rank's token positions: per pipeline stage, the
    # ranks together counted every captured position once, routed the other real tokens
    # live, and counted the left padding apart (under sequence parallelism too).
    real = sum(len(s["input_ids"]) for s in samples)
    for stage in range(len(layers_per_stage)):
        counts = [r["tokens"] for r in ranks if r["ranks"]["pp"] == stage]
        captured_total = sum(c[0] for c in counts)
        live_total = sum(c[1] for c in counts)
        padding_total = sum(c[3] for c in counts)
        assert captured_total == len(captured)
        assert live_total == real - len(captured)
        assert padding_total == sum(len(_sample_positions(s, scenario.packed)) for s in samples) - real

    # Every position of every sample, once per layer, on exactly one rank.
    positions = {(s["sample_id"], t) for s in samples for t in _sample_positions(s, scenario.packed)}
    assert set(routed) == {(layer, *p) for layer in ref["layers"] for p in positions}
    assert set(routed.values()) == {1}
    # Each loss position of the reference was computed on some rank, the grads of every parameter too.
    assert set().union(*(_losses(r) for r in ranks)) == set(ref_losses)
    assert set().union(*(r["grads"] for r in ranks)) == set(ref["grads"])


def _sample_positions(sample, packed: bool):
    return range(len(sample["input_ids"])) if packed else range(SEQ)


# ---------------------------------------------------------------------- tests


def test_data_parallel_2_each_rank_replays_its_samples_as_one_process_does(two_ranks):
    _check(two_ranks, "dp2", layers_per_stage=[[0, 1, 2, 3]])


def test_tensor_parallel_2_with_sequence_parallel_routes_each_share_as_one_process_does(two_ranks):
    _check(two_ranks, "tp2_sp", layers_per_stage=[[0, 1, 2, 3]])
    ref, ranks = two_ranks["tp2_sp"]
    # Sequence parallelism really split the tokens: each TP rank routed half of each microbatch.
    for r in ranks:
        for keys in r["row_keys"]:
            assert keys.shape[0] == SEQ * _mr_worker.MBS // 2


def test_pipeline_2_by_data_parallel_2_with_recompute_replays_every_stage_as_one_process_does(four_ranks):
    _check(four_ranks, "pp2_dp2_recompute", layers_per_stage=[[0, 1], [2, 3]])


def test_context_parallel_2_padded_routes_each_rank_chunks_as_one_process_does(context_parallel):
    _check(context_parallel, "cp2_padded", layers_per_stage=[[0, 1, 2, 3]])


def test_context_parallel_2_packed_thd_routes_each_rank_chunks_as_one_process_does(context_parallel):
    _check(context_parallel, "cp2_thd", layers_per_stage=[[0, 1, 2, 3]])
