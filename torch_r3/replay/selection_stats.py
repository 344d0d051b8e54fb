"""`IndexerStats`: what one replay of indexer selections saw, for both hooks (transformers and Megatron).

`SelectionStatsCollector` is what both hooks count with: the query rows of each
forward, split as the routes' statistics split their tokens
(`torch_r3.replay.stats.split_tokens`: padding apart), and each layer's overlap
between the model's own selection and the replayed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_r3.replay.selection_checks import overlap
from torch_r3.replay.stats import split_tokens, token_counts

__all__ = ["IndexerStats"]  # `SelectionStatsCollector` is the hooks' accumulator


@dataclass(frozen=True)
class IndexerStats:
    """What one replay (a transformers `replay()` block or a Megatron step) saw, per hooked indexer layer.

    Query rows are counted as `ReplayStats.tokens` counts tokens: `captured_rows`,
    `live_rows` and `filler_rows` are real tokens only, and rows that hold no real
    token (left padding) are `padding_rows`, however they were selected.

    Attributes:
        overlap: Layer -> mean share of each replayed selection that the
            model's own indexer also chose (1.0: the trainer agrees with the
            engine everywhere; miles uses >= 0.8 as its health gate).
        captured_rows: Real query rows replayed from the batch, summed over the forwards.
        live_rows: Real query rows without a selection left to the model's own
            indexer (`uncaptured="live"`).
        forwards: Forward passes counted (recompute is not counted again).
        filler_rows: Real query rows without a selection that attended to
            themselves only (`uncaptured="replay"`).
        padding_rows: Query rows without a real token (`attention_mask` 0, or
            without one each row's leading run of uncaptured rows).
    """

    overlap: dict[int, float]
    captured_rows: int
    live_rows: int
    forwards: int
    filler_rows: int = 0
    padding_rows: int = 0

    @property
    def mean_overlap(self) -> float:
        """The mean of `overlap` over the layers (1.0 when there were none)."""
        return sum(self.overlap.values()) / len(self.overlap) if self.overlap else 1.0

    @property
    def live_fraction(self) -> float:
        """Share of the real query rows (padding left out) that used the model's own indexer (0.0 without any)."""
        real = self.captured_rows + self.live_rows + self.filler_rows
        return self.live_rows / real if real else 0.0


class SelectionStatsCollector:
    """Counts one step's (or `replay()` block's) query rows and overlap; one host sync per forward's rows."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._rows: list[torch.Tensor] = []  # [captured real, uncaptured real, padding] per forward
        self._sums: dict[int, float] = {}
        self._measured: dict[int, int] = {}

    def add_forward(self, uncaptured: torch.Tensor, padding: torch.Tensor | None) -> None:
        """Count one forward's query rows (`True` = no captured selection; `True` = no real token)."""
        self._rows.append(split_tokens(uncaptured, padding))

    def add_overlap(self, layer: int, own: torch.Tensor, replayed: torch.Tensor) -> None:
        """Add a layer's overlap over captured `[N, K]` canonical rows (`torch_r3.replay.selection_checks.overlap`)."""
        s, n = overlap(own, replayed)
        self._sums[layer] = self._sums.get(layer, 0.0) + s
        self._measured[layer] = self._measured.get(layer, 0) + n

    def finish(self, *, live: bool) -> IndexerStats:
        """The `IndexerStats` of what was counted since `reset`."""
        share = {layer: self._sums[layer] / n for layer, n in self._measured.items() if n}
        totals = torch.stack(self._rows).sum(0).tolist() if self._rows else [0, 0, 0]
        tokens = token_counts(*totals, live=live)
        return IndexerStats(share, tokens.captured, tokens.live, len(self._rows), tokens.filler, tokens.padding)
