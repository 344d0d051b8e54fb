"""Per-step replay statistics, shared by the Megatron and transformers hooks: how far the routers would have drifted, what routed live, how evenly the experts were loaded, and the step's figures over ranks (`merge_stats`, `reduce_stats`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = [
    "ReplayStats",
    "StepCounts",
    "TokenCounts",
    "load_entropy",
    "load_imbalance",
    "merge_stats",
    "reduce_stats",
]  # `StatsCollector`, `split_tokens` and `token_counts` are the hooks' accumulators


class TokenCounts(NamedTuple):
    """Token positions routed on this rank in one step, summed over its microbatches.

    `captured`, `live` and `filler` count real tokens only; positions that hold no real token
    (left padding, packed alignment rows) are `padding`, however they were routed, so that
    the real tokens' shares do not move with how much padding a batch needed.

    Attributes:
        captured: Real tokens with a captured route (`router_padding_mask` False); they replay it.
        live: Real tokens without one that took the router's own top-k (`uncaptured="live"`).
        filler: Real tokens without one that replayed the batch's filler route
            (`uncaptured="replay"`).
        padding: Positions without a real token (`attention_mask` 0, or a packed batch's
            alignment rows); 0 for stats built with three counts.
    """

    captured: int
    live: int
    filler: int
    padding: int = 0

    @property
    def real(self) -> int:
        """The real tokens: `captured + live + filler`."""
        return self.captured + self.live + self.filler


@dataclass(frozen=True)
class StepCounts:
    """The integers behind one rank's `ReplayStats`, so that ranks can be summed exactly (`merge_stats`).

    Attributes:
        differ: Per global layer that replayed, captured tokens whose own top-k set differed from the replayed one.
        captured: Per global layer that replayed, the captured tokens it measured.
        dropped: Expert assignments the capacity limit dropped (0 unless measured).
        assignments: Replayed expert assignments the capacity limit saw (0 unless measured).
    """

    differ: dict[int, int] = field(default_factory=dict)
    captured: dict[int, int] = field(default_factory=dict)
    dropped: int = 0
    assignments: int = 0


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
        live_fraction: Share of the real tokens (padding left out) that took the
            router's own top-k because they had no captured route: `tokens.live /
            tokens.real`; 0.0 with `uncaptured="replay"`.
        tokens: Captured, live and filler real tokens, and padding positions (`TokenCounts`).
        dropped_fraction: Share of expert assignments (token, expert) that the
            capacity limit dropped; `None` unless `moe_expert_capacity_factor` is set.
        counts: The integers behind the fractions (`StepCounts`); the hooks fill
            it, and `merge_stats` needs it. `None` for stats built by hand.
        rollout_load: Per global layer, tokens per expert (a tuple of
            `num_experts` counts) in the rollout's routes, over the captured
            tokens; `None` unless the hook was built with `expert_load=True`.
        trainer_load: The same from the trainer's own router choice on the same
            captured tokens (what it would have picked without replay).

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
    counts: StepCounts | None = None
    rollout_load: dict[int, tuple[int, ...]] | None = None
    trainer_load: dict[int, tuple[int, ...]] | None = None

    @property
    def mean_drift(self) -> float:
        """Mean of `route_drift` over this rank's layers that replayed (0.0 when there are none)."""
        values = [v for v in self.route_drift.values() if v is not None]
        return sum(values) / len(values) if values else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat `{name: number}` for a metrics logger (TensorBoard, W&B, ...).

        Returns:
            One entry per layer's drift (NaN where replay never ran), plus the mean drift, the live fraction,
            the token counts and, where measured, the dropped fraction; with expert load, per layer and source
            (`rollout`, `trainer`): `expert_load/<source>/max_over_mean/layer_<l>` (`load_imbalance`) and
            `expert_load/<source>/entropy/layer_<l>` (`load_entropy`).
        """
        out: dict[str, float] = {
            f"route_drift/layer_{layer}": float("nan") if v is None else v for layer, v in self.route_drift.items()
        }
        out["route_drift/mean"] = self.mean_drift
        out["live_fraction"] = self.live_fraction
        out.update({f"tokens/{name}": n for name, n in self.tokens._asdict().items()})
        if self.dropped_fraction is not None:
            out["dropped_fraction"] = self.dropped_fraction
        for source, loads in (("rollout", self.rollout_load), ("trainer", self.trainer_load)):
            for layer, load in (loads or {}).items():
                out[f"expert_load/{source}/max_over_mean/layer_{layer}"] = load_imbalance(load)
                out[f"expert_load/{source}/entropy/layer_{layer}"] = load_entropy(load)
        return out


def load_imbalance(load: Sequence[int]) -> float:
    """The busiest expert's tokens over the mean per expert: 1.0 is perfectly even, `len(load)` is one expert only.

    NaN when no token was routed (nothing was measured).

    Examples:
        >>> load_imbalance([3, 1, 0, 0])
        3.0
    """
    total = sum(load)
    return max(load) * len(load) / total if total else float("nan")


def load_entropy(load: Sequence[int]) -> float:
    """Shannon entropy of the share of tokens per expert, over its maximum `log(len(load))`.

    1.0 is perfectly even, 0.0 is every token on one expert; NaN when no token was routed.

    Examples:
        >>> round(load_entropy([1, 1, 0, 0]), 6)  # two of four experts, evenly: log 2 / log 4
        0.5
    """
    total = sum(load)
    if not total:
        return float("nan")
    if len(load) < 2:
        return 1.0
    h = -sum(n / total * math.log(n / total) for n in load if n)
    return h / math.log(len(load))


def split_tokens(uncaptured: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """One microbatch's `[captured real, uncaptured real, padding]` positions, a 3-vector on the masks' device.

    Positions without a real token (`padding` True) are counted apart, however they were
    routed or selected, so that the real tokens' shares do not move with how much padding a
    batch needed. The routes' and the indexer selections' statistics both count this way.

    Args:
        uncaptured: `True` where a position has no captured route (or selection).
        padding: `True` where a position holds no real token; `None`: every position is real.

    Examples:
        >>> uncaptured = torch.tensor([True, True, False, True])
        >>> split_tokens(uncaptured, torch.tensor([True, False, False, False])).tolist()
        [1, 2, 1]
    """
    real = ~padding if padding is not None else torch.ones_like(uncaptured)
    return torch.stack([(~uncaptured & real).sum(), (uncaptured & real).sum(), (~real).sum()])


def token_counts(captured: int, uncaptured: int, padding: int, *, live: bool) -> TokenCounts:
    """`TokenCounts` from `split_tokens`' sums: the uncaptured real tokens are live or filler, as the hook ran.

    Examples:
        >>> token_counts(90, 10, 4, live=True)
        TokenCounts(captured=90, live=10, filler=0, padding=4)
    """
    live_tokens = uncaptured if live else 0
    return TokenCounts(captured, live_tokens, uncaptured - live_tokens, padding)


class StatsCollector:
    """Accumulates counts on the routes' device during a step; one host sync at the end."""

    def __init__(self, *, measure_drops: bool, num_experts: int | None = None):
        self._measure_drops = measure_drops
        self._num_experts = num_experts  # None: expert load off (nothing computed)
        self.reset()

    def reset(self) -> None:
        self._differ: dict[int, list[torch.Tensor]] = {}
        self._captured: dict[int, list[torch.Tensor]] = {}
        self._tokens: list[torch.Tensor] = []  # [captured, uncaptured] per microbatch
        self._live = False
        self._lost: list[torch.Tensor] = []  # dropped assignments per router call
        self._assignments = 0  # replayed assignments those calls made (a count Python knows)
        self._load: dict[int, list[torch.Tensor]] = {}  # per layer, [2, E]: rollout, trainer

    def add_microbatch(self, uncaptured: torch.Tensor, *, live: bool, padding: torch.Tensor | None = None) -> None:
        """Count one microbatch's tokens from the router-view masks (`True` = uncaptured; `True` = no real token)."""
        self._tokens.append(split_tokens(uncaptured, padding))
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
        if self._num_experts is not None:
            self._load.setdefault(layer, []).append(self._expert_counts(own, replayed, captured))

    def _expert_counts(self, own: torch.Tensor, replayed: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
        """`[2, E]` tokens per expert over the captured rows: the replayed routes, then the router's own choice."""
        assert self._num_experts is not None
        # scatter_add with the mask as weights: no boolean indexing, so no host sync per router call
        weights = captured.unsqueeze(-1).expand_as(own).reshape(-1).long()
        out = torch.zeros(2, self._num_experts, dtype=torch.long, device=own.device)
        out[0].scatter_add_(0, replayed.reshape(-1).long(), weights)
        out[1].scatter_add_(0, own.reshape(-1).long(), weights)
        return out

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
        rows += [_total([t[i] for t in self._tokens]) for i in range(3)]
        rows.append(_total(self._lost))
        device = rows[-1].device if self._lost else rows[-2].device
        loaded = [layer for layer in layers if layer in self._load]
        flat = [torch.stack([r.to(device) for r in rows])]
        flat += [torch.stack(self._load[layer]).sum(0).reshape(-1).to(device) for layer in loaded]
        counts = torch.cat(flat).tolist()  # the step's one device-to-host copy
        loads = counts[len(rows) :]
        counts = counts[: len(rows)]
        rollout_load: dict[int, tuple[int, ...]] | None = None
        trainer_load: dict[int, tuple[int, ...]] | None = None
        if self._num_experts is not None:
            e = self._num_experts
            rollout_load, trainer_load = {}, {}
            for i, layer in enumerate(loaded):
                rollout_load[layer] = tuple(loads[2 * e * i : 2 * e * i + e])
                trainer_load[layer] = tuple(loads[2 * e * i + e : 2 * e * (i + 1)])
        drift: dict[int, float | None] = {}
        for i, layer in enumerate(layers):
            differ, captured = counts[2 * i : 2 * i + 2]
            if layer not in self._differ:  # replay never ran on this layer: nothing measured
                drift[layer] = None
            else:
                drift[layer] = differ / captured if captured else 0.0
        captured_tokens, uncaptured, padding, lost = counts[-4:]
        assignments = self._assignments
        tokens = token_counts(captured_tokens, uncaptured, padding, live=self._live)
        total = tokens.real
        measured = [i for i, layer in enumerate(layers) if layer in self._differ]
        return ReplayStats(
            microbatches=self.microbatches,
            route_drift=drift,
            live_fraction=tokens.live / total if total else 0.0,
            tokens=tokens,
            dropped_fraction=(lost / assignments if assignments else 0.0) if self._measure_drops else None,
            counts=StepCounts(
                differ={layers[i]: counts[2 * i] for i in measured},
                captured={layers[i]: counts[2 * i + 1] for i in measured},
                dropped=lost if self._measure_drops else 0,
                assignments=assignments if self._measure_drops else 0,
            ),
            rollout_load=rollout_load,
            trainer_load=trainer_load,
        )


def merge_stats(parts: Sequence[ReplayStats]) -> ReplayStats:
    """One `ReplayStats` for several ranks' (or microbatch groups') stats, from their exact counts.

    Layers are the union of the parts' layers (pipeline stages hold different ones); a layer's
    drift is its summed differing tokens over its summed captured tokens; token counts,
    microbatches, dropped assignments and expert loads are summed; fractions are recomputed
    from the sums. Fractions are therefore right over any group of ranks, while token counts
    are sums over the parts: pass one rank per data-parallel replica (the data-parallel
    group) when you want the step's token counts, since tensor-, context- and
    pipeline-parallel peers see the same tokens again.

    Args:
        parts: Stats that the hooks produced (their `counts` is set).

    Raises:
        ValueError: When `parts` is empty, a part has no `counts` (built by hand), or the parts
            disagree on whether the drop or expert-load figures were measured, or on the number of experts.
    """
    if not parts:
        raise ValueError("merge_stats: no stats to merge")
    for i, p in enumerate(parts):
        if not isinstance(p, ReplayStats):
            raise TypeError(f"merge_stats: part {i} is a {type(p).__name__}, expected ReplayStats")
        if p.counts is None:
            raise ValueError(f"merge_stats: part {i} has no counts (built by hand?); only a hook's stats can be merged")
    for what in ("dropped_fraction", "rollout_load"):
        measured = {getattr(p, what) is not None for p in parts}
        if len(measured) > 1:
            raise ValueError(f"merge_stats: some parts measured {what} and some did not; build every hook alike")
    layers = sorted({layer for p in parts for layer in p.route_drift})
    differ: dict[int, int] = {}
    captured: dict[int, int] = {}
    for p in parts:
        assert p.counts is not None
        for layer, n in p.counts.differ.items():
            differ[layer] = differ.get(layer, 0) + n
        for layer, n in p.counts.captured.items():
            captured[layer] = captured.get(layer, 0) + n
    drift: dict[int, float | None] = {
        layer: (differ[layer] / captured[layer] if captured[layer] else 0.0) if layer in differ else None
        for layer in layers
    }
    tokens = TokenCounts(*(sum(p.tokens[i] for p in parts) for i in range(len(TokenCounts._fields))))
    total = tokens.real
    dropped = sum(p.counts.dropped for p in parts if p.counts is not None)
    assignments = sum(p.counts.assignments for p in parts if p.counts is not None)
    measure_drops = parts[0].dropped_fraction is not None
    return ReplayStats(
        microbatches=sum(p.microbatches for p in parts),
        route_drift=drift,
        live_fraction=tokens.live / total if total else 0.0,
        tokens=tokens,
        dropped_fraction=(dropped / assignments if assignments else 0.0) if measure_drops else None,
        counts=StepCounts(differ, captured, dropped, assignments),
        rollout_load=_sum_loads([p.rollout_load for p in parts]),
        trainer_load=_sum_loads([p.trainer_load for p in parts]),
    )


def _sum_loads(loads: Sequence[Mapping[int, tuple[int, ...]] | None]) -> dict[int, tuple[int, ...]] | None:
    if loads[0] is None:
        return None
    out: dict[int, list[int]] = {}
    for load in loads:
        for layer, counts in (load or {}).items():
            have = out.setdefault(layer, [0] * len(counts))
            if len(have) != len(counts):
                raise ValueError(f"merge_stats: layer {layer}: expert loads of {len(have)} and {len(counts)} experts")
            for e, n in enumerate(counts):
                have[e] += n
    return {layer: tuple(out[layer]) for layer in sorted(out)}


def reduce_stats(stats: ReplayStats, group: Any = None) -> ReplayStats:
    """The step's `ReplayStats` over the ranks of a `torch.distributed` process group (`merge_stats` of theirs).

    A collective: every rank of `group` calls it with its hook's `last_stats` and gets the same
    result. It gathers the stats as Python objects (`all_gather_object`: a few hundred bytes
    per rank, once per step); with NCCL, set the rank's CUDA device first, as that call asks.

    ```python
    step = reduce_stats(hook.last_stats, group=parallel_state.get_data_parallel_group())
    if torch.distributed.get_rank() == 0:
        writer.add_scalars("r3", step.as_dict(), iteration)
    ```

    Args:
        stats: This rank's stats (from a hook).
        group: The process group (default: the whole world). See `merge_stats` for which group
            gives which figures.

    Raises:
        RuntimeError: When `torch.distributed` is not initialized.
        ValueError: As `merge_stats`.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("reduce_stats: torch.distributed is not initialized (call init_process_group first)")
    if not isinstance(stats, ReplayStats):
        raise TypeError(f"reduce_stats: stats is a {type(stats).__name__}, expected ReplayStats")
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, stats, group=group)
    return merge_stats(parts)


def _total(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values).sum() if values else torch.zeros((), dtype=torch.long)
