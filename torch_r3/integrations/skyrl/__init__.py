"""`torch_r3` inside SkyRL (tested against `skyrl==0.4.0`).

`install()` (`install`) is the one call, for both sides:

* Controller (`controller`): SkyRL's route collation
  (`skyrl/train/dataset/preprocess.py`, `_collate_rollout_expert_indices` and
  `make_router_padding_mask`) becomes `torch_r3`'s, same return types, bit-identical.
* Megatron worker (`replay`): SkyRL's replay set-up
  (`skyrl/backends/skyrl_train/utils/replay_utils.py`) becomes a
  `torch_r3.megatron.ReplayHook` per model; `MegatronModelWrapper` runs unchanged.
  `microbatch(...)` (`worker`) is the collation it uses, for trainers of
  their own: SkyRL's batch form into the micro-batches the hook replays.
* Cluster (`cluster`): rollouts as `torch_r3.ray.TrajectoryRef`s, each trainer
  rank iterating `ShardCollator(RefFetch(...))` in place of the dispatcher's
  padded, `ray.put` chunks.

SkyRL is imported on first use; importing this package needs only `torch_r3`.
"""

from __future__ import annotations

from torch_r3.integrations.skyrl.cluster import put_rollouts, shard_batches
from torch_r3.integrations.skyrl.controller import collate_rollout_expert_indices, make_router_padding_mask
from torch_r3.integrations.skyrl.install import Installed, UnsupportedSkyRL, install
from torch_r3.integrations.skyrl.replay import SkyRLWorkerReplay
from torch_r3.integrations.skyrl.worker import microbatch, microbatches

__all__ = [
    "Installed",
    "SkyRLWorkerReplay",
    "UnsupportedSkyRL",
    "collate_rollout_expert_indices",
    "install",
    "make_router_padding_mask",
    "microbatch",
    "microbatches",
    "put_rollouts",
    "shard_batches",
]
