"""verl 0.9.1's own agent loop and driver, with its padded routes and with `torch_r3.integrations.verl.install()`.

What runs is verl's `AgentLoopWorker._agent_loop_postprocess` (per sample) and
`_postprocess` (per worker, building the `DataProto`), `DataProto.concat` (the
workers' outputs on the driver), `DataProto.to_tensordict` and
`left_right_2_no_padding` (what `RayPPOTrainer` hands the actor). The worker
object is set up by hand (its `__init__` starts Ray actors and loads a
tokenizer from a checkpoint): a real `transformers` tokenizer over a small
in-memory vocabulary, no processor, no reward workers, no distillation.
"""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest
import torch

from tests.integrations.frameworks import requires_full_verl

pytestmark = [requires_full_verl(), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

P, R, LAYERS, TOPK, EXPERTS = 8, 10, 3, 2, 16


def tokenizer():
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 64)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>")


def agent_loop_worker():
    """verl's `AgentLoopWorker`, with the attributes its post-processing reads (its `__init__` starts Ray actors)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.tokenizer = tokenizer()
    worker.processor = None
    worker.rollout_config = types.SimpleNamespace(prompt_length=P, response_length=R)
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = None
    return worker


def rollouts(seed, n):
    """Agent-loop outputs as a rollout returns them: tokens, and fewer routes than tokens for multi-turn ones."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(1, P + 1)), int(rng.integers(1, R + 1))
        rows = max(p + r - 1 - int(rng.integers(0, 4)) * (i % 2), 0)
        routes = np.stack([[rng.permutation(EXPERTS)[:TOPK] for _ in range(LAYERS)] for _ in range(rows)])
        out.append(
            AgentLoopOutput(
                prompt_ids=rng.integers(1, 64, p).tolist(),
                response_ids=rng.integers(1, 64, r).tolist(),
                response_mask=[1] * r,
                routed_experts=routes.astype(np.int64) if i % 3 else torch.from_numpy(routes),
                reward_score=1.0,
                num_turns=2,
                metrics=AgentLoopMetrics(),
            )
        )
    return out


def worker_batch(worker, outputs):
    """One agent-loop worker's `DataProto`: verl's per-sample, then per-worker post-processing."""
    samples = [
        asyncio.run(worker._agent_loop_postprocess(o, False, raw_prompt=[{"role": "user", "content": "x"}]))
        for o in outputs
    ]
    return worker._postprocess(samples)


def driver_batch(seed):
    """Two workers' batches concatenated on the driver, as `RayPPOTrainer` converts them for the actor."""
    from verl.protocol import DataProto
    from verl.trainer.ppo import ray_trainer

    worker = agent_loop_worker()
    data = DataProto.concat([worker_batch(worker, rollouts(seed, 3)), worker_batch(worker, rollouts(seed + 1, 4))])
    return data, ray_trainer.left_right_2_no_padding(data.to_tensordict())


def test_compact_rows_travel_in_the_dataproto_and_the_driver_gets_verls_nested_tensor():
    import torch_r3.integrations.verl as r3_verl

    theirs_proto, theirs = driver_batch(5)  # verl's own: [1, P + R, L, K] int16 per sample, concatenated, cut
    padded = theirs_proto.batch["routed_experts"]
    assert padded.shape == (7, P + R, LAYERS, TOPK) and padded.dtype == torch.int16

    with r3_verl.install(engine=False, num_experts=EXPERTS):
        ours_proto, ours = driver_batch(5)
    assert "routed_experts" not in ours_proto.batch.keys()  # no padded routes in the batch
    column = ours_proto.non_tensor_batch[r3_verl.ROUTES_FIELD]
    assert column.shape == (7,) and all(a.dtype == np.uint8 and a.ndim == 3 for a in column)
    rows = [len(o.routed_experts) for o in rollouts(5, 3) + rollouts(6, 4)]
    assert [len(a) for a in column] == rows  # the captured rows only, one byte per id
    assert sum(a.nbytes for a in column) == sum(rows) * LAYERS * TOPK

    got, want = ours["routed_experts"], theirs["routed_experts"]
    assert got.is_nested and got.dtype == want.dtype == torch.int16
    assert torch.equal(got.offsets(), want.offsets()) and got.offsets().dtype == want.offsets().dtype
    assert torch.equal(got.values(), want.values())
    for key in ("input_ids", "position_ids"):  # the rest of the actor's batch is verl's, unchanged
        assert torch.equal(ours[key].values(), theirs[key].values())
    assert torch.equal(ours["loss_mask"], theirs["loss_mask"])
    assert r3_verl.ROUTES_FIELD not in ours.keys()


def test_the_driver_refuses_a_batch_with_both_forms():
    from verl.workers.utils import padding

    import torch_r3.integrations.verl as r3_verl

    proto, _ = driver_batch(7)
    td = proto.to_tensordict()
    with r3_verl.install(engine=False):
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        td[r3_verl.ROUTES_FIELD] = NonTensorStack.from_list(
            [NonTensorData(np.zeros((1, LAYERS, TOPK))) for _ in range(7)]
        )
        with pytest.raises(ValueError, match="both routed_experts and r3_routed_experts"):
            padding.left_right_2_no_padding(td)


def test_out_of_range_expert_ids_are_refused_in_the_agent_loop():
    import torch_r3.integrations.verl as r3_verl

    outputs = rollouts(9, 1)
    outputs[0].routed_experts = np.full((2, LAYERS, TOPK), EXPERTS)
    with r3_verl.install(engine=False, num_experts=EXPERTS), pytest.raises(ValueError, match="routed_experts"):
        worker_batch(agent_loop_worker(), outputs)
