"""The framework-free replay core that every replay hook stands on.

It imports no training framework (no `megatron`, no `transformers`): only
`torch` and the rest of the core. The Megatron hook (`torch_r3.megatron`) and
the `transformers` hook (`torch_r3.transformers`) import it, never each other.

* `checks`: the batch, expert-id and router-token checks;
* `layers`: the layer map (which index of the routes' `L` each router reads);
* `padding`: which positions of a batch hold no real token (the statistics count them apart);
* `stats`: `ReplayStats`, `TokenCounts`, expert load, `merge_stats` / `reduce_stats` over ranks, and the hooks' accumulator;
* `recording`: `Recording`, what a hook recorded from the routers' own choice (R2);
* `modes`: the uncaptured-token modes and the recorded-route dtype;
* `marker`: one hook per router, by a marker attribute on the instance;
* `lifecycle`: `close()`, the context manager and the one-block-at-a-time rule of the transformers-side hooks;
* `selection_checks`, `selection_stats`: the same for the DSA indexer selections (`IndexerStats`).
"""

from __future__ import annotations

from torch_r3.replay.layers import route_layer_index, route_layer_map
from torch_r3.replay.recording import Recording
from torch_r3.replay.stats import ReplayStats, TokenCounts

__all__ = ["Recording", "ReplayStats", "TokenCounts", "route_layer_index", "route_layer_map"]
