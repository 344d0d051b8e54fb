"""torch_r3 inside verl 0.9.1: the agent loop's padded routes swapped for compact rows, then back, one call.

Run where verl is installed with its dependencies (`pip install verl==0.9.1
megatron-core==0.16.1 cachetools uvicorn fastapi`; in this repository `make
test` runs it in `.venv-verl`). It runs verl's own agent-loop post-processing
(`AgentLoopWorker._agent_loop_postprocess`, `_postprocess`) and the driver's
`left_right_2_no_padding` before and after `install()`, and shows that the
actor receives the same nested `routed_experts`, while the `DataProto` between
them carries the captured rows only. (The engine side of the same call is run
by `tests/integrations/test_verl_engine.py`: it needs a Megatron model.)
"""

from __future__ import annotations

import asyncio
import types

import numpy as np
import tokenizers
import torch
import transformers
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
from verl.trainer.ppo import ray_trainer

import torch_r3.integrations.verl as r3_verl

P, R, L, K, EXPERTS = 8, 12, 4, 2, 16  # rollout.prompt_length, rollout.response_length, layers, top-k

# An agent-loop worker as verl builds one (its __init__ starts Ray actors): a tokenizer and the rollout widths.
worker = AgentLoopWorker.__new__(AgentLoopWorker)
vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 100)}}
worker.tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
)
worker.processor, worker.mm_processor_kwargs = None, None
worker.rollout_config = types.SimpleNamespace(prompt_length=P, response_length=R)
worker.reward_loop_worker_handles, worker.distillation_enabled = None, False


def rollout(p: int, r: int, rows: int) -> AgentLoopOutput:
    """One sample as the rollout server returns it: tokens, and `rows` routes (n - 1, or fewer after tool turns)."""
    routes = np.stack([[rng.permutation(EXPERTS)[:K] for _ in range(L)] for _ in range(rows)])
    return AgentLoopOutput(
        prompt_ids=rng.integers(1, 100, p).tolist(),
        response_ids=rng.integers(1, 100, r).tolist(),
        response_mask=[1] * r,
        routed_experts=routes,
        reward_score=1.0,
        metrics=AgentLoopMetrics(),
    )


def step():
    """verl's agent loop for three samples, then what the driver hands the actor."""
    outputs = [rollout(3, 6, 8), rollout(5, 12, 13), rollout(2, 4, 5)]  # the second: a multi-turn rollout
    samples = [asyncio.run(worker._agent_loop_postprocess(o, False, raw_prompt=[])) for o in outputs]
    batch = worker._postprocess(samples)  # the worker's DataProto, shipped to the driver
    return batch, ray_trainer.left_right_2_no_padding(batch.to_tensordict())


rng = np.random.default_rng(0)
verl_batch, verl_actor = step()  # verl's own: a zero-filled int16 [1, P + R, L, K] per sample
padded = verl_batch.batch["routed_experts"]
print("verl:", tuple(padded.shape), padded.dtype, padded.numel() * padded.element_size(), "bytes of routes")

rng = np.random.default_rng(0)  # the same rollouts
with r3_verl.install(engine=False, num_experts=EXPERTS):  # at start-up, in the agent-loop workers and the driver
    r3_batch, r3_actor = step()
column = r3_batch.non_tensor_batch[r3_verl.ROUTES_FIELD]
print("torch_r3:", [a.shape for a in column], column[0].dtype, sum(a.nbytes for a in column), "bytes of routes")

same = torch.equal(r3_actor["routed_experts"].values(), verl_actor["routed_experts"].values())
same &= torch.equal(r3_actor["routed_experts"].offsets(), verl_actor["routed_experts"].offsets())
print("actor's nested routed_experts identical:", same, r3_actor["routed_experts"].dtype)
# verl: (3, 20, 4, 2) torch.int16 960 bytes of routes
# torch_r3: [(8, 4, 2), (13, 4, 2), (5, 4, 2)] uint8 208 bytes of routes
# actor's nested routed_experts identical: True torch.int16
