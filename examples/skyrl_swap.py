"""torch_r3 inside SkyRL 0.4.0: the controller's route collation swapped in, the worker's micro-batch built.

Run where SkyRL is installed (`pip install skyrl==0.4.0` on Python 3.12; in this
repository `make test` runs it in `.venv-frameworks`). It calls SkyRL's own
`convert_prompts_responses_to_batch_tensors`, the function
`RayPPOTrainer.convert_to_training_input` calls, before and after `install()`,
and shows the two batches are the same bytes; then it builds one Megatron
micro-batch for `torch_r3.megatron.ReplayHook` from SkyRL's batch form.
"""

from __future__ import annotations

import numpy as np
import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.dataset import preprocess

import torch_r3.integrations.skyrl as r3_skyrl
from torch_r3 import BufferPool, Memory, Padded

rng = np.random.default_rng(0)
L, K, EXPERTS = 4, 2, 16
prompts = [rng.integers(1, 100, p).tolist() for p in (3, 5, 2, 4)]
responses = [rng.integers(1, 100, r).tolist() for r in (6, 2, 5, 3)]
rewards = [[0.0] * (len(r) - 1) + [1.0] for r in responses]
loss_masks = [[1] * len(r) for r in responses]
# What SkyRL's vLLM endpoint returns per trajectory: one row per token but the last, compact (uint8).
routes = [
    np.stack([[rng.permutation(EXPERTS)[:K] for _ in range(L)] for _ in range(len(p) + len(r) - 1)]).astype(np.uint8)
    for p, r in zip(prompts, responses)
]


def training_input() -> TrainingInputBatch:
    out = preprocess.convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, rewards, loss_masks, None, routes
    )
    return TrainingInputBatch(
        {
            "sequences": out[0],
            "attention_mask": out[1],
            "rollout_expert_indices": out[6],
            "router_padding_mask": preprocess.make_router_padding_mask(out[1], [len(r) for r in routes]),
        }
    )


before = training_input()  # SkyRL's own serial collation
with r3_skyrl.install(
    memory=Memory(buffers=BufferPool())
):  # the swap: one call at trainer start-up, before the first step
    after = training_input()  # the same SkyRL function, now collating with torch_r3
    packed = after["rollout_expert_indices"]
    print(type(packed).__name__, tuple(packed.values.shape), packed.values.dtype, packed.cu_seqlens.tolist())
    print(
        "bit-identical:",
        all(
            torch.equal(
                before[k].values if k == "rollout_expert_indices" else before[k],
                after[k].values if k == "rollout_expert_indices" else after[k],
            )
            for k in ("sequences", "attention_mask", "rollout_expert_indices", "router_padding_mask")
        ),
    )

# On the Megatron worker: each micro-batch of the mini-batch, in SkyRL's right-padded model layout,
# as the batches a torch_r3.megatron.ReplayHook step replays (`hook.forward_backward(data_iterator=...)`).
microbatches = list(r3_skyrl.microbatches(after.chunk(2), layout=Padded(side="right", pad_to_multiple_of=1)))
first = microbatches[0]
print(tuple(first["rollout_expert_indices"].shape), first["attention_mask"].tolist())
print(first["router_padding_mask"].int().tolist())
# PackedTensor (30, 4, 2) torch.uint8 [0, 9, 16, 23, 30]
# bit-identical: True
# (2, 9, 4, 2) [[1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0, 0]]
# [[0, 0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1, 1, 1]]
