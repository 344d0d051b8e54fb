"""`read_routing_trace` on files written by Megatron-core 0.19's own router tracer (it runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from torch_r3.runlog import read_routing_trace, trace_expert_load

router_trace = pytest.importorskip(
    "megatron.core.transformer.moe.router_trace", reason="Megatron-core < 0.19 has no router tracer"
)


def test_the_reader_reads_megatrons_own_trace_and_counts_its_expert_load(tmp_path):
    tracer = router_trace.RouterTracer(str(tmp_path), max_steps=2, rank=3, training_mode=True)
    g = torch.Generator().manual_seed(0)
    steps = []
    for step in (7, 8):
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5 * 2)]).view(5, 2, 2)  # [N, L, K]
        tracer.record_indices(ids, layer_ids=[1, 3])
        tracer.advance_step(step_id=step)
        steps.append(ids)
    tracer.flush()
    records = read_routing_trace(tmp_path / "router_trace_rank3.jsonl")
    assert [(r.step, r.layer, r.rank, r.block, r.mtp_idx) for r in records] == [
        (7, 1, 3, "decoder", None),
        (7, 3, 3, "decoder", None),
        (8, 1, 3, "decoder", None),
        (8, 3, 3, "decoder", None),
    ]
    for r, (ids, i) in zip(records, [(steps[0], 0), (steps[0], 1), (steps[1], 0), (steps[1], 1)]):
        assert r.top_indices.tolist() == ids[:, i].tolist()
    load = trace_expert_load(records, num_experts=6)
    assert load[(8, 3)] == tuple(torch.bincount(steps[1][:, 1].reshape(-1), minlength=6).tolist())
    assert sum(load[(7, 1)]) == 5 * 2
    with pytest.raises(ValueError, match=r"expert id 5 is not below num_experts=5"):
        trace_expert_load(records, num_experts=5)
