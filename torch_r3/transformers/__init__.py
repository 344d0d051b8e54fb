"""Hugging Face `transformers` integration: replay captured routes in a model's MoE routers.

This is the only part of `torch_r3` that imports `transformers` (the
`transformers` extra); it stands on the replay core (`torch_r3.replay`) and never imports the Megatron hook.

Public names:

* `ReplayHook` finds the MoE routers of one model instance, replays a
  collated batch's routes in them inside `with hook.replay(batch):` (the
  weights of the replayed experts recomputed from the live logits, so the
  router trains), follows activation checkpointing, reports `last_stats`, and
  records the model's own routes with `hook.record()` (R2).
* `Recording` is what `record()` yields (`torch_r3.replay.Recording`, the type
  the Megatron hook records too).
* `FAMILIES`, `Family` and `supported_families()`: the router classes it knows
  and how each family weights a choice of experts.
"""

from __future__ import annotations

from torch_r3._extras import require

require("transformers", "transformers")  # without transformers: name the extra that installs it
from torch_r3.replay.recording import Recording
from torch_r3.replay.stats import ReplayStats, TokenCounts
from torch_r3.transformers.families import FAMILIES, Family, supported_families
from torch_r3.transformers.hook import ReplayHook

__all__ = ["FAMILIES", "Family", "Recording", "ReplayHook", "ReplayStats", "TokenCounts", "supported_families"]
