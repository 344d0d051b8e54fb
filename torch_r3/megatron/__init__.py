"""Megatron-core integration: replay captured routes in the training routers.

This is the only part of ``torch_r3`` that imports Megatron (``megatron-core >= 0.16``,
the first release with ``router_replay``). It depends on the core, never the
other way round.

Public names:

* :class:`ReplayHook` installs each microbatch's ``rollout_expert_indices`` into
  one model's routers for the forward and for activation recompute, sliced to
  this rank's pipeline stage, tensor/sequence-parallel share and
  context-parallel chunks, and checks the replay FIFOs after every step.
* :class:`InterleavedPipelineError` is raised for the interleaved (virtual
  pipeline) schedule, which replay cannot follow.
* The pure slicing helpers (:func:`context_parallel_positions`,
  :func:`sequence_parallel_positions`, :func:`packed_positions`,
  :func:`slice_for_rank`, :func:`router_indices`, :func:`moe_layer_pattern`, :func:`route_layer_index`,
  :func:`stage_layer_range`), for users who install routes themselves.
"""

from __future__ import annotations

from torch_r3._extras import require

require("megatron.core", "megatron")  # without megatron-core: name the extra that installs it
from torch_r3.megatron.hook import InterleavedPipelineError, ReplayHook
from torch_r3.megatron.slicing import (
    RankSlice,
    context_parallel_positions,
    moe_layer_pattern,
    packed_positions,
    route_layer_index,
    router_indices,
    sequence_parallel_positions,
    slice_for_rank,
    stage_layer_range,
)

__all__ = [
    "InterleavedPipelineError",
    "RankSlice",
    "ReplayHook",
    "context_parallel_positions",
    "moe_layer_pattern",
    "packed_positions",
    "route_layer_index",
    "router_indices",
    "sequence_parallel_positions",
    "slice_for_rank",
    "stage_layer_range",
]
