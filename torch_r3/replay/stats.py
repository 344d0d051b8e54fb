"""Per-step replay statistics, shared by the Megatron and transformers hooks: how far the routers would have drifted, and what routed live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["ReplayStats", "TokenCounts"]  # `StatsCollector` is the hooks' accumulator


class TokenCounts(NamedTuple):
    """Token positions routed on this rank in one step, summed over its microbatches.

    Attributes:
        captured: Positions with a captured route (`router_padding_mask` False); they replay it.
        live: Positions without one that took the router's own top-k (`uncaptured="live"`).
        filler: Positions without one that replayed the batch's filler route
            (`uncaptured="replay"`).
    """

    captured: int
    live: int
    filler: int


@dataclass(frozen=True)
class ReplayStats:
    """What replay did in one `forward_backward` (or `step()`), on this rank's routers.

    Counted in forward passes only (activation recompute would count every
    microbatch twice). Each rank reports its own routers and tokens; reduce
    across ranks yourself if you want one figure per step.

    Attributes:
        microbatches: Microbatches this rank ran.
        route_drift: Per global layer (0-based), the fraction of captured tokens
            whose own top-k set differs from the replayed set: how far training
            would have drifted from inference without replay. `None` for a layer
            whose replay never ran in the step (nothing was measured, which is
            not the same as no drift).
        live_fraction: Share of routed tokens that took the router's own top-k.
        tokens: Captured, live and filler token positions (`TokenCounts`).
        dropped_fraction: Share of expert assignments (token, expert) that the
            capacity limit dropped; `None` unless `moe_expert_capacity_factor` is set.

    Examples:
        >>> stats = ReplayStats(2, {0: 0.25, 1: 0.5}, 0.1, TokenCounts(90, 10, 0), None)
        >>> stats.mean_drift
        0.375
        >>> stats.as_dict()["route_drift/layer_1"], stats.as_dict()["tokens/live"]
        (0.5, 10)
    """

    microbatches: int
    route_drift: dict[int, float | None]
    live_fraction: float
    tokens: TokenCounts
    dropped_fraction: float | None = None

    @property
    def mean_drift(self) -> float:
        """Mean of `route_drift` over this rank's layers that replayed (0.0 when there are none)."""
        values = [v for v in self.route_drift.values() if v is not None]
        return sum(values) / len(values) if values else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat `{name: number}` for a metrics logger (TensorBoard, W&B, ...).

        Returns:
            One entry per layer's drift (NaN where replay never ran), plus the mean drift, the live fraction,
            the token counts and, where measured, the dropped fraction.
        """
        out: dict[str, float] = {
            f"route_drift/layer_{layer}": float("nan") if v is None else v for layer, v in self.route_drift.items()
        }
        out["route_drift/mean"] = self.mean_drift
        out["live_fraction"] = self.live_fraction
        out.update({f"tokens/{name}": n for name, n in self.tokens._asdict().items()})
        if self.dropped_fraction is not None:
            out["dropped_fraction"] = self.dropped_fraction
        return out


class StatsCollector:
    """Accumulates counts on the routes' device during a step; one host sync at the end."""

    def __init__(self, *, measure_drops: bool):
        self._measure_drops = measure_drops
        self.reset()

    def reset(self) -> None:
        self._differ: dict[int, list[torch.Tensor]] = {}
        self._captured: dict[int, list[torch.Tensor]] = {}
        self._tokens: list[torch.Tensor] = []  # [captured, uncaptured] per microbatch
        self._live = False
        self._lost: list[torch.Tensor] = []  # dropped assignments per router call
        self._assignments = 0  # replayed assignments those calls made (a count Python knows)

    def add_microbatch(self, uncaptured: torch.Tensor, *, live: bool) -> None:
        """Count one microbatch's tokens from the router-view mask (`True` = uncaptured)."""
        n = uncaptured.sum()
        self._tokens.append(torch.stack([uncaptured.numel() - n, n]))
        self._live = live

    @property
    def microbatches(self) -> int:
        """Microbatches counted since the last `reset`."""
        return len(self._tokens)

    def add_drift(self, layer: int, own: torch.Tensor, replayed: torch.Tensor, captured: torch.Tensor) -> None:
        """Count captured rows where the router's own `[N, K]` choice differs from the replayed one."""
        # torch.topk(sorted=False) and the engines order the K experts freely: compare as sets.
        differ = (own.sort(-1).values != replayed.sort(-1).values).any(-1) & captured
        self._differ.setdefault(layer, []).append(differ.sum())
        self._captured.setdefault(layer, []).append(captured.sum())

    def add_drops(self, chosen: torch.Tensor, kept_map: torch.Tensor) -> None:
        """Count the `[N, K]` assignments in `chosen` that the final `[N, E]` map no longer holds."""
        kept = kept_map.gather(1, chosen)
        self._lost.append((~kept).sum())
        self._assignments += kept.numel()

    def finish(self, layers: tuple[int, ...]) -> ReplayStats:
        """Build the step's `ReplayStats` for these global layers (one device-to-host copy)."""
        rows = []
        for layer in layers:
            rows += [_total(self._differ.get(layer, [])), _total(self._captured.get(layer, []))]
        rows += [_total([t[0] for t in self._tokens]), _total([t[1] for t in self._tokens])]
        rows.append(_total(self._lost))
        device = rows[-1].device if self._lost else rows[-2].device
        counts = torch.stack([r.to(device) for r in rows]).tolist()
        drift: dict[int, float | None] = {}
        for i, layer in enumerate(layers):
            differ, captured = counts[2 * i : 2 * i + 2]
            if layer not in self._differ:  # replay never ran on this layer: nothing measured
                drift[layer] = None
            else:
                drift[layer] = differ / captured if captured else 0.0
        captured_tokens, uncaptured, lost = counts[-3:]
        assignments = self._assignments
        live = uncaptured if self._live else 0
        total = captured_tokens + uncaptured
        return ReplayStats(
            microbatches=self.microbatches,
            route_drift=drift,
            live_fraction=live / total if total else 0.0,
            tokens=TokenCounts(captured_tokens, live, uncaptured - live),
            dropped_fraction=(lost / assignments if assignments else 0.0) if self._measure_drops else None,
        )


def _total(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values).sum() if values else torch.zeros((), dtype=torch.long)
