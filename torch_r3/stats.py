"""Per-step replay statistics: re-exported from `torch_r3.replay.stats`, their home."""

from __future__ import annotations

from torch_r3.replay.stats import ReplayStats, StatsCollector as StatsCollector, TokenCounts

__all__ = ["ReplayStats", "TokenCounts"]  # `StatsCollector` is the hooks' accumulator
