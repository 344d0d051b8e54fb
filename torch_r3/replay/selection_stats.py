"""`IndexerStats`: what one replay of indexer selections saw, for both hooks (transformers and Megatron)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IndexerStats"]


@dataclass(frozen=True)
class IndexerStats:
    """What one replay (a transformers `replay()` block or a Megatron step) saw, per hooked indexer layer.

    Attributes:
        overlap: Layer -> mean share of each replayed selection that the
            model's own indexer also chose (1.0: the trainer agrees with the
            engine everywhere; miles uses >= 0.8 as its health gate).
        captured_rows: Query rows replayed from the batch, per forward.
        live_rows: Query rows left to the model's own indexer, per forward.
        forwards: Forward passes counted (recompute is not counted again).
    """

    overlap: dict[int, float]
    captured_rows: int
    live_rows: int
    forwards: int

    @property
    def mean_overlap(self) -> float:
        """The mean of `overlap` over the layers (1.0 when there were none)."""
        return sum(self.overlap.values()) / len(self.overlap) if self.overlap else 1.0
