"""Megatron-core integration: replay captured routes in the training routers.

This is the only part of `torch_r3` that imports Megatron (`megatron-core >= 0.16`,
the first release with `router_replay`). It depends on the core, never the
other way round; it stands on the replay core
(`torch_r3.replay`) and never imports the `transformers` hook.

Public names:

* `ReplayHook` installs each microbatch's `rollout_expert_indices` into one
  model's routers for the forward and for activation recompute, sliced to this
  rank's pipeline stage, tensor/sequence-parallel share and context-parallel
  chunks; it checks the routes before any router uses them, routes tokens
  without a captured route live (by default), and checks the replay FIFOs
  after every step.
* `ReplayStats` (with `TokenCounts`) is what `ReplayHook.last_stats` holds after
  a step: per-layer route drift, live share, token counts, capacity drops.
* `Recording` (`ReplayHook.last_recording`): the routes a recording step chose (R2).
* `IndexerReplayHook` (`torch_r3.megatron.indexer`, megatron-core 0.19) replays
  each microbatch's DSA indexer selections (`rollout_indexer_topk`) in one
  model's `DSAttention` layers, with `ReplayHook`'s step contract.
* `InterleavedPipelineError` is raised for the interleaved (virtual pipeline)
  schedule, which this product refuses by contract.
* The pure slicing helpers (`context_parallel_positions`,
  `sequence_parallel_positions`, `packed_positions`, `slice_for_rank`,
  `router_indices`, `moe_layer_pattern`, `hybrid_moe_pattern`,
  `route_layer_index`, `route_layer_map`, `stage_layer_range`) and
  `check_route_values`, for users who install routes themselves.
"""

from __future__ import annotations

from torch_r3._extras import require

require("megatron.core", "megatron")  # without megatron-core: name the extra that installs it
from torch_r3.megatron import slicing
from torch_r3.megatron.batch_checks import check_route_values
from torch_r3.megatron.hook import ReplayHook
from torch_r3.megatron.indexer import IndexerReplayHook
from torch_r3.megatron.setup_checks import InterleavedPipelineError

# Redundant aliases mark these as re-exports: `__all__` lists them through `*slicing.__all__`,
# which static tools cannot expand.
from torch_r3.megatron.slicing import (
    RankSlice as RankSlice,
    context_parallel_positions as context_parallel_positions,
    hybrid_moe_pattern as hybrid_moe_pattern,
    moe_layer_pattern as moe_layer_pattern,
    packed_positions as packed_positions,
    route_layer_index as route_layer_index,
    route_layer_map as route_layer_map,
    router_indices as router_indices,
    sequence_parallel_positions as sequence_parallel_positions,
    slice_for_rank as slice_for_rank,
    stage_layer_range as stage_layer_range,
)
from torch_r3.replay.recording import Recording
from torch_r3.replay.stats import ReplayStats, TokenCounts

__all__ = [
    "IndexerReplayHook",
    "InterleavedPipelineError",
    "Recording",
    "ReplayHook",
    "ReplayStats",
    "TokenCounts",
    "check_route_values",
    *slicing.__all__,
]
