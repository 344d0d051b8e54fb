"""Pure functions that cut a global batch of routes down to what one rank's routers see.

Megatron's MoE router sees the hidden states of its own rank, flattened
sequence-first: row `s * B + b` is sequence position `s` of sample `b`.
Which positions a rank holds depends on context parallelism (the sequence is cut
into `2 * cp_size` chunks and rank `r` keeps chunks `r` and
`2 * cp_size - 1 - r`, so that causal attention work is balanced) and on
sequence parallelism (after that, each tensor-parallel rank keeps one contiguous
`1 / tp_size` share). Which layers a rank holds depends on its pipeline stage.

These helpers take sizes and ranks as arguments and never ask a process group,
so they are easy to test against a reference; `ReplayHook` asks
`parallel_state` and passes the answers in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torch_r3._checks import check_non_negative, check_positive
from torch_r3.replay.layers import route_layer_index, route_layer_map

__all__ = [
    "RankSlice",
    "context_parallel_positions",
    "hybrid_moe_pattern",
    "moe_layer_pattern",
    "packed_positions",
    "route_layer_index",
    "route_layer_map",
    "router_indices",
    "sequence_parallel_positions",
    "slice_for_rank",
    "stage_layer_range",
]


PACKED_BALANCING = ("per_document", "per_sequence")
"""Context-parallel partitioning modes of a packed batch that the slicing follows exactly."""


@dataclass(frozen=True)
class RankSlice:
    """Where one rank sits in the parallel layout, as the slicing helpers need it.

    Attributes:
        cp_size: Context-parallel world size.
        cp_rank: This rank's context-parallel rank.
        tp_size: Tensor-parallel world size.
        tp_rank: This rank's tensor-parallel rank.
        sequence_parallel: Whether Megatron's sequence parallelism splits the
            sequence over the tensor-parallel ranks before the MoE layers.

    Examples:
        >>> RankSlice(cp_size=2, cp_rank=1).splits_sequence
        False
        >>> RankSlice(tp_size=2, tp_rank=0, sequence_parallel=True).splits_sequence
        True
    """

    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self):
        for size, rank, what in ((self.cp_size, self.cp_rank, "cp"), (self.tp_size, self.tp_rank, "tp")):
            size = check_positive(size, f"{what}_size")
            rank = check_non_negative(rank, f"{what}_rank")
            if rank >= size:
                raise ValueError(f"{what}_rank must be an int in [0, {size}), got {rank!r}")
            object.__setattr__(self, f"{what}_size", size)
            object.__setattr__(self, f"{what}_rank", rank)

    @property
    def splits_sequence(self) -> bool:
        """True when sequence parallelism actually splits the sequence (`tp_size > 1`)."""
        return self.sequence_parallel and self.tp_size > 1


def context_parallel_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions a context-parallel rank holds, in the order it holds them.

    Megatron (`get_batch_on_this_cp_rank`) cuts the sequence into `2 * cp_size`
    equal chunks and gives rank `r` chunks `r` and `2 * cp_size - 1 - r`.

    Args:
        seq_len: Global sequence length; must be a multiple of `2 * cp_size`.
        cp_size: Context-parallel world size.
        cp_rank: Context-parallel rank.

    Returns:
        A `torch.long` tensor of `seq_len // cp_size` positions.

    Raises:
        ValueError: When `seq_len` is not a multiple of `2 * cp_size`.

    Examples:
        >>> context_parallel_positions(8, 2, 0).tolist()
        [0, 1, 6, 7]
        >>> context_parallel_positions(8, 2, 1).tolist()
        [2, 3, 4, 5]
    """
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} must be a multiple of 2 * context_parallel_size "
            f"= {2 * cp_size} (Megatron's load-balanced context-parallel split)"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def sequence_parallel_positions(seq_len: int, tp_size: int, tp_rank: int) -> slice:
    """The contiguous share of a (context-parallel local) sequence a TP rank routes.

    With sequence parallelism, `scatter_to_sequence_parallel_region` gives each
    tensor-parallel rank one contiguous `seq_len / tp_size` block.

    Args:
        seq_len: Sequence length after context-parallel slicing.
        tp_size: Tensor-parallel world size.
        tp_rank: Tensor-parallel rank.

    Returns:
        A `slice` over the sequence dimension.

    Raises:
        ValueError: When `seq_len` is not a multiple of `tp_size`.

    Examples:
        >>> sequence_parallel_positions(8, 4, 1)
        slice(2, 4, None)
    """
    if seq_len % tp_size:
        raise ValueError(
            f"sequence length {seq_len} (after context-parallel slicing) must be a multiple "
            f"of tensor_model_parallel_size = {tp_size} with sequence_parallel"
        )
    share = seq_len // tp_size
    return slice(tp_rank * share, (tp_rank + 1) * share)


def packed_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token positions a context-parallel rank holds in a packed (THD) batch.

    In the packed layout each sequence is split on its own into `2 * cp_size`
    chunks (as Transformer Engine's THD partitioning does), and the rank's two
    chunks of every sequence are concatenated in sequence order.

    Args:
        cu_seqlens: `[B + 1]` cumulative sequence lengths, starting at 0.
        cp_size: Context-parallel world size.
        cp_rank: Context-parallel rank.

    Returns:
        A `torch.long` tensor of `cu_seqlens[-1] // cp_size` token positions.

    Raises:
        ValueError: When `cu_seqlens` is malformed or a sequence length is not
            a multiple of `2 * cp_size`.

    Examples:
        >>> packed_positions(torch.tensor([0, 4, 8]), 2, 1).tolist()
        [1, 2, 5, 6]
    """
    bounds = _check_cu_seqlens(cu_seqlens)
    total = bounds[-1]
    if cp_size == 1:
        return torch.arange(total)
    parts = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"cu_seqlens: sequence {i} has {length} tokens; with context parallelism "
                f"every packed sequence must be padded to a multiple of 2 * "
                f"context_parallel_size = {2 * cp_size} (collate with "
                f"layout=torch_r3.Packed(pad_to_multiple_of={2 * cp_size}) and pass its cu_seqlens_padded)"
            )
        parts.append(start + context_parallel_positions(length, cp_size, cp_rank))
    return torch.cat(parts) if parts else torch.arange(0)


def _check_cu_seqlens(cu_seqlens) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor [B + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens: expected shape [B + 1], got {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens: expected an integer tensor, got dtype {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing values starting at 0, got {bounds}")
    return bounds


def router_indices(local_routes: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer's routes in the order a router sees its tokens.

    Args:
        local_routes: This rank's routes, `[B, S, L, K]`.
        layer: Index into the `L` dimension.

    Returns:
        `[S * B, K]`, row `s * B + b` holding sample `b`'s position `s`.

    Examples:
        >>> r = torch.arange(8).reshape(2, 2, 1, 2)  # B=2, S=2, L=1, K=2
        >>> router_indices(r, 0).tolist()
        [[0, 1], [4, 5], [2, 3], [6, 7]]
    """
    b, s, _, k = local_routes.shape
    return local_routes[:, :, layer, :].transpose(0, 1).reshape(s * b, k)


def moe_layer_pattern(config: Any) -> tuple[bool, ...]:
    """Which global layers are MoE layers, from `config.moe_layer_freq`.

    An int `f` makes every `f`-th layer (`0, f, 2f, ...`) an MoE layer; a
    list gives the pattern per layer (`1` MoE, `0` dense), as Megatron's layer
    specs read it.

    Args:
        config: A `TransformerConfig` (or anything with `num_layers` and
            `moe_layer_freq`).

    Returns:
        One bool per global layer.

    Raises:
        ValueError: When `moe_layer_freq` has the wrong length or type.

    Examples:
        >>> from types import SimpleNamespace
        >>> moe_layer_pattern(SimpleNamespace(num_layers=4, moe_layer_freq=2))
        (True, False, True, False)
        >>> moe_layer_pattern(SimpleNamespace(num_layers=3, moe_layer_freq=[0, 1, 1]))
        (False, True, True)
    """
    freq = getattr(config, "moe_layer_freq", 1)
    num_layers = config.num_layers
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries, expected num_layers = {num_layers}")
        return tuple(bool(x) for x in freq)
    freq = check_positive(freq, "moe_layer_freq")  # not a list: an every-n-th-layer frequency
    return tuple(i % freq == 0 for i in range(num_layers))


def hybrid_moe_pattern(pattern: str) -> tuple[bool, ...]:
    """Which global layers of a `HybridModel` are MoE layers, from its `hybrid_layer_pattern`.

    One symbol per layer (`E` MoE, `*` attention, `-` MLP, `M` Mamba, ...);
    `|` separates pipeline stages and everything after the first `/` describes
    multi-token prediction layers, which route live and are not counted.

    Args:
        pattern: The model's `hybrid_layer_pattern`.

    Returns:
        One bool per decoder layer.

    Raises:
        ValueError: When the pattern has no layer.

    Examples:
        >>> hybrid_moe_pattern("*E|*E/*E")
        (False, True, False, True)
    """
    main = pattern.split("/", 1)[0].replace("|", "")
    if not main:
        raise ValueError(f"hybrid_layer_pattern={pattern!r} has no decoder layer")
    return tuple(symbol == "E" for symbol in main)


def stage_layer_range(config: Any, *, vp_stage: int | None = None, pp_rank: int | None = None) -> range:
    """The global layers (0-based) built on a pipeline stage, from Megatron's own helpers.

    Uses `get_transformer_layer_offset` and `get_num_layers_to_build`, so
    uneven first/last stages and `pipeline_model_parallel_layout` count the way
    Megatron counts them.

    Args:
        config: The model's `TransformerConfig`.
        vp_stage: Virtual pipeline stage of the model chunk, if any.
        pp_rank: Pipeline rank; by default this process's, from `parallel_state`.

    Returns:
        `range(offset, offset + num_layers_on_stage)`.
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + count)


def slice_for_rank(
    routes: torch.Tensor,
    padding_mask: torch.Tensor,
    rank: RankSlice,
    *,
    cu_seqlens: torch.Tensor | None = None,
    model_scatters_mask: bool = True,
    packed_balancing: str = "per_document",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a global microbatch of routes to what this rank's routers see.

    Args:
        routes: `[B, T, L, K]` (padded layout) or `[N, L, K]` (packed layout,
            with `cu_seqlens`).
        padding_mask: `[B, T]` or `[N]` bool, `True` where no route was captured.
        rank: This rank's place in the context/tensor-parallel layout.
        cu_seqlens: `[B + 1]` sequence offsets for the packed layout, else
            `None`: for a batch collated with per-sequence alignment, its
            `cu_seqlens_padded` (the offsets the rows follow, and the bounds
            Transformer Engine's THD context-parallel split uses).
        model_scatters_mask: Whether the model itself applies the
            sequence-parallel split to `padding_mask` (Megatron's `GPTModel`
            does on its first pipeline stage only). When false, the returned mask
            is split here too.
        packed_balancing: How context parallelism splits a packed batch:
            `"per_document"` (each sequence on its own into `2 * cp_size`
            chunks; Megatron's default with `cu_seqlens`) or `"per_sequence"`
            (the whole packed row as one sequence; Megatron's
            `use_per_sequence_balancing=True`).

    Returns:
        `(routes [B', S, L, K], padding_mask)`: `S` is the sequence length
        one router sees per sample (`B' = 1` for the packed layout); the mask
        is what the model's `forward` should get as `padding_mask`.

    Raises:
        ValueError: When the sequence length does not split evenly over the
            context-parallel (or sequence-parallel) ranks, or `cu_seqlens` does
            not cover the packed routes.

    Examples:
        >>> routes = torch.arange(8).reshape(1, 8, 1, 1)  # B=1, T=8, L=1, K=1
        >>> mask = torch.zeros(1, 8, dtype=torch.bool)
        >>> local, _ = slice_for_rank(routes, mask, RankSlice(cp_size=2, cp_rank=1))
        >>> local.flatten().tolist()
        [2, 3, 4, 5]
        >>> local, local_mask = slice_for_rank(routes, mask, RankSlice(tp_size=2, tp_rank=1, sequence_parallel=True))
        >>> local.flatten().tolist(), list(local_mask.shape)  # the model scatters the mask itself
        ([4, 5, 6, 7], [1, 8])
    """
    if packed_balancing not in PACKED_BALANCING:
        raise ValueError(
            f"packed_balancing={packed_balancing!r}: context-parallel partitioning mode not supported; "
            f"expected one of {PACKED_BALANCING}"
        )
    if cu_seqlens is not None:
        if packed_balancing == "per_sequence":
            total = _check_cu_seqlens(cu_seqlens)[-1]
            if total != routes.shape[0]:
                raise ValueError(f"cu_seqlens covers {total} tokens, rollout_expert_indices has {routes.shape[0]}")
            positions = context_parallel_positions(routes.shape[0], rank.cp_size, rank.cp_rank)
        else:
            positions = packed_positions(cu_seqlens, rank.cp_size, rank.cp_rank)
        if positions.numel() * rank.cp_size != routes.shape[0]:
            raise ValueError(
                f"cu_seqlens covers {positions.numel() * rank.cp_size} tokens, "
                f"rollout_expert_indices has {routes.shape[0]}"
            )
        if rank.cp_size > 1:  # without CP the positions are 0..N-1: no gather (and no copy) needed
            routes, padding_mask = routes[positions.to(routes.device)], padding_mask[positions.to(padding_mask.device)]
        routes, padding_mask = routes.unsqueeze(0), padding_mask.unsqueeze(0)
    elif rank.cp_size > 1:
        positions = context_parallel_positions(routes.shape[1], rank.cp_size, rank.cp_rank)
        routes = routes[:, positions.to(routes.device)]
        padding_mask = padding_mask[:, positions.to(padding_mask.device)]
    if rank.splits_sequence:
        share = sequence_parallel_positions(routes.shape[1], rank.tp_size, rank.tp_rank)
        routes = routes[:, share]
        if not model_scatters_mask:
            padding_mask = padding_mask[:, share]
    return routes, padding_mask
