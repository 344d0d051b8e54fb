"""Where a batch holds no real token, for the statistics, which count those positions apart.

The routes' `ReplayStats.tokens` and the DSA selections' `IndexerStats` both
leave padding out of their shares (`torch_r3.replay.stats.split_tokens`);
`padding_positions` says which positions of a batch are padding, for every hook
that has no padding mask of its own to hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torch_r3.keys import ATTENTION_MASK, CU_SEQLENS_PADDED, ROUTER_MASK

__all__: list[str] = []  # the hooks' internals


def padding_positions(
    batch: Mapping[str, Any],
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    mask_key: str = ROUTER_MASK,
    payload: str = "routes",
) -> torch.Tensor:
    """`[rows, positions]` bool, `True` where the batch holds no real token (for the stats, which count it apart).

    `mask` is the batch's uncaptured mask, `mask_key` (`router_padding_mask`, or
    `indexer_padding_mask` for the `payload` "selections").

    Padded: the batch's `attention_mask == 0`; without one, each row's leading run of
    uncaptured positions (left padding). Packed: none, except the alignment rows between
    sequences when the batch carries `cu_seqlens_padded`.
    """
    if cu_seqlens is not None:
        aligned = batch.get(CU_SEQLENS_PADDED)
        return alignment_padding(mask, cu_seqlens, None if aligned is None else torch.as_tensor(aligned))
    attention = checked_attention_mask(batch)
    if attention is None:
        return (~mask).cumsum(1) == 0
    if tuple(attention.shape) != tuple(mask.shape):
        raise ValueError(
            f"{ATTENTION_MASK}: shape {list(attention.shape)} differs from {mask_key}'s {list(mask.shape)}: "
            f"the {payload} do not cover the tokens"
        )
    return attention.to(mask.device) == 0


def alignment_padding(like: torch.Tensor, cu_seqlens: torch.Tensor, aligned: torch.Tensor | None) -> torch.Tensor:
    """The packed layout's padding, shaped like `like` (`[T]` or `[1, T]`): none, or the alignment rows.

    `True` between the sequences of `cu_seqlens` laid out at the offsets `aligned`
    (`cu_seqlens_padded`); all `False` without `aligned`.
    """
    if aligned is None:
        return torch.zeros_like(like)
    pad = torch.ones_like(like)
    row = pad if pad.dim() == 1 else pad[0]
    for start, n in zip(aligned.tolist(), cu_seqlens.diff().tolist()):
        row[start : start + n] = False
    return pad


def checked_attention_mask(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The batch's `attention_mask`, or `None` without one.

    Raises:
        TypeError: When it is not an integer or bool tensor.
    """
    attention = batch.get(ATTENTION_MASK)
    if attention is None:
        return None
    if not isinstance(attention, torch.Tensor) or attention.dtype.is_floating_point or attention.is_complex():
        what = attention.dtype if isinstance(attention, torch.Tensor) else type(attention).__name__
        raise TypeError(f"{ATTENTION_MASK}: expected an integer or bool torch.Tensor, got {what}")
    return attention
