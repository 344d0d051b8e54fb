"""torch_r3 inside SkyRL 0.4.0: one `install()` for both sides, the controller's batch unchanged to the byte.

Run where SkyRL and its Megatron worker are installed (the guide's recipe; in
this repository `make test` runs it in `.venv-frameworks`). It lists the SkyRL
functions `install()` replaced (the controller's collation, the Megatron
worker's replay set-up: in a process where SkyRL's Megatron model wrapper does
not import, only the first two, and `handle.worker_skipped` says why), calls
SkyRL's own `convert_prompts_responses_to_batch_tensors`, the function
`RayPPOTrainer.convert_to_training_input` calls, before and after `install()`,
and shows the two batches are the same bytes; then it builds one Megatron
micro-batch, as the installed worker set-up does, from SkyRL's batch form.
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
) as handle:  # the swap: one call per process, before the first step
    for name in handle.names:
        print("replaced", name.removeprefix("skyrl."))
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

# What the installed worker set-up collates per micro-batch, in SkyRL's right-padded model layout:
# the batches a torch_r3.megatron.ReplayHook replays (for a trainer of your own: its data_iterator).
microbatches = list(r3_skyrl.microbatches(after.chunk(2), layout=Padded(side="right", pad_to_multiple_of=1)))
first = microbatches[0]
print(tuple(first["rollout_expert_indices"].shape), first["attention_mask"].tolist())
print(first["router_padding_mask"].int().tolist())
# replaced train.dataset.preprocess._collate_rollout_expert_indices
# replaced train.dataset.preprocess.make_router_padding_mask
# replaced backends.skyrl_train.utils.replay_utils.setup_per_microbatch_replay_forward
# replaced backends.skyrl_train.utils.replay_utils.setup_per_microbatch_replay_backward
# replaced backends.skyrl_train.utils.replay_utils.router_replay_schedule
# replaced backends.skyrl_train.utils.replay_utils.patch_topk_router_layer_number
# replaced backends.skyrl_train.workers.megatron.megatron_model_wrapper.get_forward_backward_func
# PackedTensor (30, 4, 2) torch.uint8 [0, 9, 16, 23, 30]
# bit-identical: True
# (2, 9, 4, 2) [[1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0, 0]]
# [[0, 0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1, 1, 1]]
