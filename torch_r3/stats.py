"""Per-step replay statistics: re-exported from `torch_r3.replay.stats`, their home."""

from __future__ import annotations

from torch_r3.replay.stats import ReplayStats, StatsCollector, TokenCounts

__all__ = ["ReplayStats", "StatsCollector", "TokenCounts"]
