"""The checks a replay hook makes on a batch's selections before the model runs, with no framework imported.

A replayed selection that is out of range or not causal lets a query attend
to padding or to the future; a repeated position silently attends to fewer
than `index_topk` positions. So every captured row is checked once, when
`replay()` is entered, with whole-tensor reductions and one host sync when
the batch is clean:

* `check_selection_batch`: keys, dtypes and shapes (`[B, T, L, K]` of
  `int16`/`int32`/`int64` and a `[B, T]` bool mask);
* `check_selection_values`: in every captured row of every replayed layer,
  the positions are distinct, lie in `[first, t]` (`first` the sample's first
  captured row, `t` the query's own position), and there are exactly
  `min(K, t - first + 1)` of them, the rest `-1`; the first bad row is named
  (layer, batch row, position, what is wrong);
* `canonical_rows`: a model's own `[B, T, K']` top-k turned into that form
  (positions outside `[first, t]`, which the attention mask hides anyway,
  dropped; sorted; `-1` after), for statistics and `record()`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torch_r3.collate.selections import SELECTION_MASK, SELECTIONS
from torch_r3.keys import CU_SEQLENS
from torch_r3.replay.checks import check_tensor_dtype
from torch_r3.selections import FILL

__all__ = [
    "CHECK_PIECES",
    "CHECK_SLOTS",
    "canonical_rows",
    "check_selection_batch",
    "check_selection_values",
    "first_positions",
]

SELECTION_TENSOR_DTYPES = (torch.int16, torch.int32, torch.int64)


def check_selection_batch(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's `[B, T, L, K]` selections and `[B, T]` mask, after checking their kinds and shapes.

    Raises:
        TypeError: `batch` is not a mapping, or a tensor has the wrong dtype.
        ValueError: a key is missing, the batch is packed, or the shapes disagree.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch: expected a mapping of tensors, got {type(batch).__name__}")
    missing = [k for k in (SELECTIONS, SELECTION_MASK) if k not in batch]
    if missing:
        raise ValueError(f"batch: missing {missing}; collate the selections with torch_r3.indexer.collate_selections")
    if CU_SEQLENS in batch and batch[SELECTIONS].ndim == 3:
        raise ValueError(
            "batch: packed selections ([N, L, K] with cu_seqlens) need a packed forward; use the padded layout"
        )
    sel, mask = batch[SELECTIONS], batch[SELECTION_MASK]
    check_tensor_dtype(sel, SELECTIONS, SELECTION_TENSOR_DTYPES, "an int16/int32/int64 torch.Tensor")
    check_tensor_dtype(mask, SELECTION_MASK, (torch.bool,), "a torch.bool tensor")
    if sel.ndim != 4 or mask.shape != sel.shape[:2]:
        raise ValueError(
            f"{SELECTIONS} {list(sel.shape)} and {SELECTION_MASK} {list(mask.shape)}: expected [B, T, L, K] and [B, T]"
        )
    return sel, mask


def first_positions(mask: torch.Tensor) -> torch.Tensor:
    """`[B]`: each row's first captured position (its first real token), `T` where it has none."""
    captured = ~mask
    T = mask.shape[1]
    idx = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(captured, idx, T).min(dim=1).values


def check_selection_values(sel: torch.Tensor, mask: torch.Tensor, layers: Sequence[int], prefix: str = "") -> None:
    """Refuse the first captured row whose selection is not valid (see the module docstring).

    The rows are checked in pieces (whole rows) of `CHECK_SLOTS` slots, or of
    a `CHECK_PIECES`-th of the batch where that is more (so that a large batch
    on a GPU costs a bounded number of kernel launches): the check's own memory
    is one piece's temporaries, about 34 bytes a slot (34 MiB, or about a
    quarter of an `int16` batch's bytes), not 17 times the batch as at once.
    Each piece's verdict stays on the device: one host sync for a clean batch.

    Args:
        sel: `[B, T, L, K]` selections in batch positions, `-1` in unused slots.
        mask: `[B, T]`, `True` where a row has no captured selection (not checked).
        layers: The model layer each of the `L` columns holds (for messages).
        prefix: Put before the message (e.g. `"microbatch 0, "`).

    Raises:
        ValueError: naming the layer, the batch row, the position and the fault.
    """
    B, T, L, K = sel.shape
    if B * T == 0:
        return
    first = first_positions(mask)
    slots = max(CHECK_SLOTS, B * T * L * K // CHECK_PIECES)
    pieces = _pieces(B, T, max(1, slots // max(1, L * K)))
    verdicts = torch.stack([_faults(sel, mask, first, piece)[-1].any() for piece in pieces])
    if not bool(verdicts.any()):
        return
    b0, _b1, t0, _t1 = piece = pieces[int(verdicts.to(torch.uint8).argmax())]  # the first piece with a bad row
    v, f_, _t, count, want, dup, bad_slot, bad = _faults(sel, mask, first, piece)
    b, pos, col = (int(x) for x in bad.nonzero()[0])
    row, f, n = v[b, pos, col], int(f_[b, 0, 0, 0]), int(count[b, pos, col])
    where = f"{prefix}layer {layers[col]}, batch row {b0 + b}, position {t0 + pos}"
    if bool((row < FILL).any()) or bool(bad_slot[b, pos, col].any()):
        p = int(row[(row < FILL) | bad_slot[b, pos, col]][0])
        what = f"selects position {p}, outside [{f}, {t0 + pos}] (the sample's first token .. the query: causal)"
    elif bool(dup[b, pos, col]):
        what = "selects a position twice"
    else:
        what = f"selects {n} positions, expected {int(want[b, pos, col])} (index_topk={K} or all it sees)"
    raise ValueError(f"{where}: {what}")


CHECK_SLOTS = 1 << 20
"""Selection slots (`B * T * L * K` elements) `check_selection_values` checks in one piece, at least."""

CHECK_PIECES = 64
"""At most about this many pieces per batch (a larger batch gets larger pieces)."""


def _pieces(B: int, T: int, rows: int) -> list[tuple[int, int, int, int]]:
    """`(b0, b1, t0, t1)` pieces of at most `rows` rows of `[B, T]`, in row-major order (so the first bad is first)."""
    if T <= rows:
        step = rows // T
        return [(b, min(b + step, B), 0, T) for b in range(0, B, step)]
    return [(b, b + 1, t, min(t + rows, T)) for b in range(B) for t in range(0, T, rows)]


def _faults(
    sel: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, piece: tuple[int, int, int, int]
) -> tuple[torch.Tensor, ...]:
    """One piece's values, first positions, query positions, counts, wanted counts, duplicates, bad slots, bad rows."""
    b0, b1, t0, t1 = piece
    K = sel.shape[-1]
    v = sel[b0:b1, t0:t1].to(torch.int64)
    f = first[b0:b1].view(-1, 1, 1, 1)
    t = torch.arange(t0, t1, device=sel.device).view(1, -1, 1, 1)
    valid = v != FILL
    bad_slot = valid & ~((v >= f) & (v <= t))
    count = valid.sum(-1)
    want = torch.minimum(t[..., 0] - f[..., 0] + 1, torch.tensor(K, device=sel.device))
    big = torch.iinfo(torch.int64).max
    srt = torch.where(valid, v, big).sort(dim=-1).values
    dup = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] != big)).any(-1)
    del srt
    bad = bad_slot.any(-1) | dup | (count != want) | (v < FILL).any(-1)
    bad &= ~mask[b0:b1, t0:t1].view(b1 - b0, t1 - t0, 1)
    return v, f, t, count, want, dup, bad_slot, bad


def canonical_rows(own: torch.Tensor, first: torch.Tensor, topk: int) -> torch.Tensor:
    """A model's own top-k `[B, T, K']` as checked selections `[B, T, topk]`, in its dtype (at least `int32`).

    Positions outside `[first[b], t]` are dropped (the attention mask hides
    them: future positions and left padding), the rest sorted, `-1` after.
    """
    B, T, Kp = own.shape
    v = own.to(torch.promote_types(own.dtype, torch.int32))
    t = torch.arange(T, device=own.device).view(1, T, 1)
    ok = (v >= first.view(B, 1, 1)) & (v <= t)
    big = torch.iinfo(v.dtype).max
    srt = torch.where(ok, v, big).sort(dim=-1).values
    srt = torch.where(srt == big, FILL, srt)
    if Kp < topk:
        srt = torch.cat([srt, srt.new_full((B, T, topk - Kp), FILL)], dim=-1)
    return srt[..., :topk]


def overlap(own: torch.Tensor, replayed: torch.Tensor) -> tuple[float, int]:
    """Sum over rows of the share of `replayed`'s positions that `own` also holds, and the row count.

    Both are `[N, K]` canonical rows (sorted, `-1` after), of any integer dtypes
    (compared in the wider of the two, at least `int32`); rows of `replayed`
    without any position are not counted.
    """
    dtype = torch.promote_types(torch.promote_types(own.dtype, replayed.dtype), torch.int32)
    own = own.to(dtype)
    rep = replayed.to(dtype).masked_fill(replayed == FILL, torch.iinfo(dtype).max)
    idx = torch.searchsorted(rep, own.contiguous()).clamp(max=rep.shape[-1] - 1)
    hit = (rep.gather(-1, idx) == own) & (own != FILL)
    n = (replayed != FILL).sum(-1)
    rows = n > 0
    if not bool(rows.any()):
        return 0.0, 0
    return float((hit.sum(-1)[rows] / n[rows]).sum()), int(rows.sum())
