"""Collation: one route array per trajectory into the training batch, every byte written once.

Stage 3 of the data path (engine -> rollout -> health -> **collate** -> replay -> trainer).

* `collator`: `R3Collator` and `collate_routes`, the kernel's entry points;
* `layout`: the layout values (`Padded`, `Packed`, `PromptResponse`, `Memory`);
* `geometry`: `BatchGeometry` and `global_geometry`, a batch's shape from metadata alone;
* `shard`: `ShardCollator` and `plan_microbatches`, per-rank collation at cluster scale;
* `nested`: `as_nested`, a batch as a nested tensor;
* `selections`: the DSA indexer's selections through the same kernel;
* `route_inputs`, `samples`, `filler`, `writers`, `pool`, `memory`, `buffers`: what the kernel stands on
  (the per-sample checks, the samples' keys, the filler rows, the writers, the copy threads, where an
  output lives and the recycled outputs, `BufferPool`).
"""

from __future__ import annotations

from torch_r3.collate.collator import R3Collator, collate_routes, padding_rows

__all__ = ["R3Collator", "collate_routes", "padding_rows"]
