"""`torch_r3` inside SkyRL (tested against `skyrl==0.4.0`).

* Controller (`controller`): `install()` swaps SkyRL's route collation
  (`skyrl/train/dataset/preprocess.py`, `_collate_rollout_expert_indices` and
  `make_router_padding_mask`) for `torch_r3`'s, same return types, bit-identical.
* Worker (`worker`): `microbatches(...)` turns SkyRL's batch form (a
  `TrainingInputBatch` mini-batch: packed routes, left-padded masks) into the
  micro-batches `torch_r3.megatron.ReplayHook` replays, in SkyRL's Megatron
  token layout (right-padded, or packed with `cu_seqlens_padded`), in place of
  `setup_per_microbatch_replay_forward` and `router_replay_schedule`.
* Cluster (`cluster`): rollouts as `torch_r3.ray.TrajectoryRef`s, each trainer
  rank iterating `ShardCollator(RefFetch(...))` in place of the dispatcher's
  padded, `ray.put` chunks.

SkyRL is imported on first use; importing this package needs only `torch_r3`.
"""

from __future__ import annotations

from torch_r3.integrations.skyrl.cluster import put_rollouts, shard_batches
from torch_r3.integrations.skyrl.controller import (
    Installed,
    collate_rollout_expert_indices,
    install,
    make_router_padding_mask,
)
from torch_r3.integrations.skyrl.worker import microbatch, microbatches

__all__ = [
    "Installed",
    "collate_rollout_expert_indices",
    "install",
    "make_router_padding_mask",
    "microbatch",
    "microbatches",
    "put_rollouts",
    "shard_batches",
]
