"""vLLM's order inside a route row is not the router's: the drift statistics compare sets.

On the real vLLM 0.30 routes of `fixtures/vllm_served_routes.json` (see
`test_health_vllm_routes.py`), next to the rebuilt checkpoint's own router top-k: most rows
come in another order than descending router logit, the replay hooks' drift counter
(`StatsCollector.add_drift`, used by both hooks) counts none of them, and it counts exactly
the rows whose expert set was changed.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_r3.replay.stats import StatsCollector

pytest.importorskip(
    "transformers", reason="the reference forward needs transformers: pip install 'torch_r3[transformers]'"
)

from tests.engines.checkpoints import QWEN3, load, router_logits

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_served_routes.json").read_text())


def test_vllms_row_order_is_no_drift_and_a_changed_set_is(tmp_path):
    model = load(QWEN3.write(tmp_path / "qwen3"))
    engine, own = [], []
    for r in FIXTURE["requests"]:
        routes = np.load(io.BytesIO(base64.b64decode(r["routes"])), allow_pickle=False).astype(np.int64)
        logits = torch.from_numpy(router_logits(model, (r["prompt"] + r["response"])[:-1])[r["start"] :])
        engine.append(torch.from_numpy(routes))
        own.append(logits.topk(QWEN3.topk, dim=-1).indices)  # descending logit: the router's own order
    engine_rows, own_rows = torch.cat(engine), torch.cat(own)  # [N, L, K]
    reordered = (engine_rows != own_rows).any(-1)  # same set (checked below), other order
    assert torch.equal(engine_rows.sort(-1).values, own_rows.sort(-1).values)
    assert reordered.float().mean() > 0.5

    changed = engine_rows.clone()
    changed[::7, 1, 0] = (changed[::7, 1].max(-1).values + 1) % QWEN3.num_experts  # maybe in the set already
    differs = torch.tensor(  # [N, L], by Python sets
        [[set(c.tolist()) != set(o.tolist()) for c, o in zip(cr, orow)] for cr, orow in zip(changed, own_rows)]
    )
    collector = StatsCollector(measure_drops=False)
    captured = torch.ones(engine_rows.shape[0], dtype=torch.bool)
    for layer in range(QWEN3.layers):
        collector.add_drift(layer, own_rows[:, layer], changed[:, layer], captured)
    stats = collector.finish(tuple(range(QWEN3.layers)))
    assert stats.counts is not None
    assert stats.counts.differ == {layer: int(differs[:, layer].sum()) for layer in range(QWEN3.layers)}
    assert stats.counts.differ[0] == 0 and stats.counts.differ[1] > 0
