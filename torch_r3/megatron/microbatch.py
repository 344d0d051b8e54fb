"""One microbatch's layout on this rank: its packed offsets, its padding mask, and this rank's share.

`prepare_microbatch` reads where each packed sequence starts (`cu_seqlens`, or
the aligned `cu_seqlens_padded` when the batch carries one) and the padding
mask Megatron's model gets; `rank_share` cuts the routes and both masks to
what this rank's routers and model see under context and sequence parallelism
(`slicing.slice_for_rank`), and derives the router's sequence-first view of
the uncaptured tokens and the `input_ids` shape the model must be given.
`current_rank` asks `parallel_state` for the sizes and ranks that the pure
functions of `slicing` take as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state

from torch_r3.megatron.batch_checks import check_aligned_offsets, model_padding_mask
from torch_r3.megatron.slicing import RankSlice, sequence_parallel_positions, slice_for_rank

__all__: list[str] = []  # the hook's internals


@dataclass(frozen=True)
class MicrobatchLayout:
    """Where a microbatch's sequences sit, before any rank's cut.

    Attributes:
        offsets: Where each packed sequence starts in the rows (`cu_seqlens_padded`
            when the batch is aligned, else `cu_seqlens`); `None` for a padded batch.
        padding_mask: The model's padding mask over the whole microbatch (`True`
            only where there is no real token), shaped like `router_padding_mask`.
    """

    offsets: torch.Tensor | None
    padding_mask: torch.Tensor


@dataclass(frozen=True)
class RankShare:
    """What this rank's routers and model see of one microbatch.

    Attributes:
        routes: This rank's routes, `[B, S_local, L, K]` (`B = 1` when packed).
        uncaptured: The router's view of `router_padding_mask`, flattened
            sequence-first (`[S_local * B]`).
        model_mask: The padding mask handed to the model's forward.
        input_shape: The `input_ids` shape the model must be given, `(B, S)`.
        padding: The router's view of the padding mask (`True` where there is no
            real token), flattened like `uncaptured`: the stats count it apart.
    """

    routes: torch.Tensor
    uncaptured: torch.Tensor
    model_mask: torch.Tensor
    input_shape: tuple[int, int]
    padding: torch.Tensor


def current_rank(config: Any) -> RankSlice:
    """This process's context- and tensor-parallel sizes and ranks, from `parallel_state`.

    Outside an initialised model-parallel world it is a world of one, with
    sequence parallelism as `config` says.
    """
    sp = bool(getattr(config, "sequence_parallel", False))
    if not parallel_state.model_parallel_is_initialized():
        return RankSlice(sequence_parallel=sp)
    return RankSlice(
        cp_size=parallel_state.get_context_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        sequence_parallel=sp,
    )


def prepare_microbatch(
    batch: Mapping[str, Any],
    uncaptured: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    microbatch: int,
    layer: int,
) -> MicrobatchLayout:
    """The microbatch's packed offsets (`cu_seqlens_padded` checked against `cu_seqlens`) and padding mask.

    Args:
        batch: The microbatch dict.
        uncaptured: Its `router_padding_mask`, on the model's device.
        cu_seqlens: The packed layout's offsets, or `None` for a padded batch.
        microbatch: Index of the microbatch in the step, for messages.
        layer: The stage's first MoE layer (global, 0-based), for messages.
    """
    aligned = check_aligned_offsets(batch, cu_seqlens, uncaptured.shape[0]) if cu_seqlens is not None else None
    pad = model_padding_mask(
        batch, uncaptured, cu_seqlens, microbatch=microbatch, layer=layer, cu_seqlens_padded=aligned
    )
    return MicrobatchLayout(offsets=cu_seqlens if aligned is None else aligned, padding_mask=pad)


def rank_share(
    routes: torch.Tensor,
    uncaptured: torch.Tensor,
    layout: MicrobatchLayout,
    rank: RankSlice,
    *,
    model_scatters_mask: bool,
    packed_balancing: str,
) -> RankShare:
    """Cut a microbatch's routes and masks to this rank's share.

    Args:
        routes: The microbatch's routes, `[B, T, L, K]` or packed `[T, L, K]`.
        uncaptured: Its `router_padding_mask`, shaped like the routes' rows.
        layout: Its offsets and padding mask (`prepare_microbatch`).
        rank: This rank's sizes and ranks.
        model_scatters_mask: Whether the model scatters `padding_mask` for
            sequence parallelism itself (GPTModel's first stage); otherwise the
            model's mask is cut to this rank's share here.
        packed_balancing: How context parallelism splits packed sequences.
    """
    # Only the first stage's model scatters padding_mask for sequence parallelism;
    # later stages hand it to the MoE layers as given. Both masks are cut in one pass.
    local, masks = slice_for_rank(
        routes,
        torch.stack([uncaptured, layout.padding_mask], -1),
        rank,
        cu_seqlens=layout.offsets,
        model_scatters_mask=model_scatters_mask,
        packed_balancing=packed_balancing,
    )
    router_mask, model_mask = masks[..., 0], masks[..., 1]
    router_padding = model_mask
    width = masks.shape[1]
    if model_scatters_mask and rank.splits_sequence:
        positions = sequence_parallel_positions(width, rank.tp_size, rank.tp_rank)
        router_mask, router_padding = router_mask[:, positions], router_padding[:, positions]
    elif rank.splits_sequence:
        width *= rank.tp_size  # the mask holds this rank's share; input_ids the whole (CP-local) row
    return RankShare(
        routes=local,
        uncaptured=router_mask.transpose(0, 1).reshape(-1),
        model_mask=model_mask,
        input_shape=(masks.shape[0], width),
        padding=router_padding.transpose(0, 1).reshape(-1),
    )
