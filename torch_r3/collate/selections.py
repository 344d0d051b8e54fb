"""A batch's indexer selections, in the layouts routes use, every output byte written once.

Selections differ from routes in one way that matters here: they are
*positions*. A trajectory's row `j` names positions of that trajectory, counted
from its first token; in the batch they must name batch positions. So:

* `layout=Padded()` (side `"left"`, the default, like the route batch):
  sample `i`'s `n_i` tokens sit at `T - n_i .. T - 1`, and every selected
  position is shifted by `T - n_i`; `Padded(side="right")` shifts by 0;
* `layout=Packed()`: sample `i` starts at `cu_seqlens[i]` of the packed token
  axis, and its positions are shifted by that offset;
* unused slots (a query that sees fewer than `index_topk` positions) stay `-1`
  (`FILL`), unshifted, and rows with no captured selection (left padding, the
  uncaptured tail) are `-1` throughout, with `indexer_padding_mask` `True`.

Context parallelism does not shift anything: a context-parallel rank keeps
the query rows of its sequence chunks and their positions still name the
whole sequence's keys (which the indexer gathers from every rank); the query
rows a rank holds are those of its routes (`torch_r3.megatron.slicing`).

`Padded(seq_len=)` fixes `T` (a rank collating only its own micro-batches with the
global batch's `T` gets exactly the global batch's rows), `keep_layers=` keeps
a pipeline stage's layers, and `dtype=` fixes the output dtype across ranks.
The output is `int16` while every position fits (`T` or the packed length at
most 32768), else `int32`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_dtype, check_int
from torch_r3.collate import _memory, _pool
from torch_r3.collate.geometry import check_output_size, padded_length
from torch_r3.collate.layout import Memory, Packed, Padded, from_keywords
from torch_r3.keys import ATTENTION_MASK, CU_SEQLENS
from torch_r3.selections import FILL, IndexerSelections

__all__ = ["SELECTIONS", "SELECTION_MASK", "collate_selections", "selection_dtype"]

SELECTIONS = "rollout_indexer_topk"
"""Batch key of the selections: `[B, T, L, K]` (padded) or `[sum(n), L, K]` (packed), batch positions."""

SELECTION_MASK = "indexer_padding_mask"
"""Batch key: `True` where a token position has no captured selection."""

SELECTION_DTYPES = (np.dtype(np.int16), np.dtype(np.int32))
_TORCH = {np.dtype(np.int16): torch.int16, np.dtype(np.int32): torch.int32}
# Query rows per task: a long trajectory is decoded by several threads, each from its own row.
_PIECE_ROWS = 4096


def selection_dtype(positions: int) -> np.dtype:
    """The narrowest selection dtype for a batch axis of `positions` tokens (`int16` up to 32768).

    Examples:
        >>> selection_dtype(32768), selection_dtype(32769)
        (dtype('int16'), dtype('int32'))
    """
    return SELECTION_DTYPES[0] if positions <= 1 << 15 else SELECTION_DTYPES[1]


def _check_inputs(selections: Any, token_counts: Any) -> tuple[list[IndexerSelections], list[int]]:
    if isinstance(selections, (str, bytes)) or not isinstance(selections, Sequence):
        raise TypeError(f"selections must be a sequence of IndexerSelections, got {type(selections).__name__}")
    sels = list(selections)
    counts = [check_int(c, f"token_counts[{i}]") for i, c in enumerate(token_counts)]
    if not sels:
        raise ValueError("selections: the batch is empty")
    if len(counts) != len(sels):
        raise ValueError(f"token_counts has {len(counts)} entries for {len(sels)} samples")
    for i, s in enumerate(sels):
        if not isinstance(s, IndexerSelections):
            raise TypeError(f"sample {i}: expected IndexerSelections, got {type(s).__name__}")
        if (s.num_layers, s.index_topk) != (sels[0].num_layers, sels[0].index_topk):
            raise ValueError(
                f"sample {i}: selections of [layers={s.num_layers}, index_topk={s.index_topk}], sample 0 has "
                f"[{sels[0].num_layers}, {sels[0].index_topk}]"
            )
        if counts[i] < 1:
            raise ValueError(f"sample {i}: token count must be >= 1, got {counts[i]}")
        if s.rows > counts[i]:
            raise ValueError(f"sample {i}: {s.rows} selection rows for {counts[i]} tokens (rows must be <= tokens)")
    return sels, counts


def _check_keep(keep_layers: Any, num_layers: int) -> list[int]:
    if keep_layers is None:
        return list(range(num_layers))
    if isinstance(keep_layers, (str, bytes)) or not hasattr(keep_layers, "__iter__"):
        raise TypeError(f"keep_layers must be a sequence of layer indices, got {type(keep_layers).__name__}")
    keep = [check_int(x, "keep_layers[]") for x in keep_layers]
    if not keep:
        raise ValueError("keep_layers must name at least one layer")
    for x in keep:
        if not 0 <= x < num_layers:
            raise ValueError(f"keep_layers: layer {x} is not in [0, {num_layers})")
    if len(set(keep)) != len(keep):
        raise ValueError(f"keep_layers: a layer is named twice in {keep}")
    return keep


def collate_selections(
    selections: Sequence[IndexerSelections],
    token_counts: Sequence[int],
    *,
    layout: Padded | Packed | str = "padded",
    keep_layers: Sequence[int] | None = None,
    dtype: Any = None,
    memory: Memory | None = None,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """Collate per-trajectory selections into one batch, positions in batch coordinates.

    Args:
        selections: One `IndexerSelections` per trajectory, all of the same
            layers and `index_topk`.
        token_counts: Each trajectory's token count `n_i` (`rows <= n_i`).
        layout: as in `torch_r3.collate_routes`: `torch_r3.Padded(side=,
            pad_to_multiple_of=, seq_len=)` (`[B, T, L, K]`; give the global
            batch's `seq_len`) or `torch_r3.Packed()` (`[sum(n), L, K]`; its
            per-sequence alignment is not supported); `"padded"`/`"packed"`
            for the defaults.
        keep_layers: Indices of the layer axis to keep (a pipeline stage's).
        dtype: `int16` or `int32`; by default the narrowest that holds every
            position of the batch axis.
        memory: a `torch_r3.Memory`: copy threads (`workers`, the caller's
            included; default: the CPUs), `pin_memory` and `max_output_bytes`
            as in `torch_r3.collate_routes`. Its `buffers` and `cache_bytes`
            are refused (the selections are always freshly allocated).
        **deprecated: `padding_side=`, `pad_to_multiple_of=`, `seq_len=` and
            `workers=`, each with a `DeprecationWarning` naming its new spelling.

    Returns:
        `{"rollout_indexer_topk", "indexer_padding_mask"}` plus
        `"attention_mask"` (padded) or `"cu_seqlens"` (packed).

    Raises:
        TypeError: a sample is not `IndexerSelections`, an argument has the wrong type.
        ValueError: samples disagree on layers or `index_topk`, rows exceed
            tokens, a setting is out of range or `dtype` cannot hold a position;
            the outputs would take more bytes than the bound `collate_routes`
            uses (the physical memory, or `TORCH_R3_MAX_OUTPUT_BYTES`),
            refused before anything is allocated.

    Examples:
        >>> import numpy as np
        >>> sel = IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 0]]]))
        >>> from torch_r3 import Padded
        >>> batch = collate_selections([sel], [4], layout=Padded(seq_len=6))
        >>> batch["rollout_indexer_topk"][0, :, 0].tolist()
        [[-1, -1], [-1, -1], [2, -1], [2, 3], [2, 4], [-1, -1]]
        >>> batch["indexer_padding_mask"][0].tolist()
        [True, True, False, False, False, True]
    """
    value, memory = from_keywords(
        "collate_selections",
        layout,
        memory,
        dict(deprecated),
        keywords=("padding_side", "pad_to_multiple_of", "seq_len", "workers"),
        allowed=(Padded, Packed),
    )
    if memory.buffers is not None or memory.cache_bytes is not None:
        raise ValueError("collate_selections: Memory.buffers and Memory.cache_bytes are not supported (fresh memory)")
    if isinstance(value, Packed) and value.pad_to_multiple_of is not None:
        raise ValueError(f"collate_selections: a packed batch with pad_to_multiple_of is not supported, got {value!r}")
    sels, counts = _check_inputs(selections, token_counts)
    keep = _check_keep(keep_layers, sels[0].num_layers)
    B, K, Lo = len(sels), sels[0].index_topk, len(keep)
    if isinstance(value, Padded):
        if value.seq_len is not None:
            T = value.seq_len
            for i, n in enumerate(counts):
                if n > T:
                    raise ValueError(f"sample {i} has {n} tokens, more than seq_len={T}")
        else:
            T = padded_length(counts, value.pad_to_multiple_of)
        axis = T
        starts = [T - n if value.side == "left" else 0 for n in counts]
        shapes = {SELECTIONS: (B, T, Lo, K), SELECTION_MASK: (B, T), ATTENTION_MASK: (B, T)}
    else:
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        axis = int(cu[-1])
        if axis >= 2**31:
            raise ValueError(f"packed batch of {axis} tokens does not fit int32 cu_seqlens")
        starts = [int(c) for c in cu[:-1]]
        shapes = {SELECTIONS: (axis, Lo, K), SELECTION_MASK: (axis,), CU_SEQLENS: (B + 1,)}
    out_dtype = selection_dtype(axis) if dtype is None else check_dtype(dtype, "dtype", SELECTION_DTYPES)
    if axis - 1 > np.iinfo(out_dtype).max:
        raise ValueError(f"dtype={out_dtype} cannot hold position {axis - 1} of a batch axis of {axis} tokens")
    torch_dtypes = {
        SELECTIONS: _TORCH[out_dtype],
        SELECTION_MASK: torch.bool,
        ATTENTION_MASK: torch.long,
        CU_SEQLENS: torch.int32,
    }
    check_output_size({k: (shape, torch_dtypes[k]) for k, shape in shapes.items()}, memory.max_output_bytes)
    kind = _memory.memory_kind(memory.pin_memory)
    result = {k: _memory.empty(shape, torch_dtypes[k], kind) for k, shape in shapes.items()}
    views = {k: v.numpy() for k, v in result.items()}
    sel_out, mask_out = views[SELECTIONS], views[SELECTION_MASK]
    padded = isinstance(value, Padded)
    if not padded:
        views[CU_SEQLENS][:] = cu

    # One task per sample, source layer and piece of rows: it decodes once into the first output
    # layer that uses the source and copies that into the others (shared layers are decoded once);
    # a long trajectory's rows are cut into pieces that threads share.
    tasks: list[tuple[int, list[int], int, int]] = []
    for i, s in enumerate(sels):
        groups: dict[int, list[int]] = {}
        for k, layer in enumerate(keep):
            groups.setdefault(s.layer_source[layer], []).append(k)
        cuts = list(range(0, s.rows, _PIECE_ROWS)) + [s.rows]
        pieces = list(zip(cuts[:-1], cuts[1:])) or [(0, 0)]
        tasks.extend((i, ks, lo, hi) for ks in groups.values() for lo, hi in pieces)
    first_task = {i: t for t, (i, *_rest) in reversed(list(enumerate(tasks)))}

    def write_tasks(lo: int, hi: int) -> None:
        for t in range(lo, hi):
            i, ks, r_lo, r_hi = tasks[t]
            s, r, n = starts[i], sels[i].rows, counts[i]
            rows = sel_out[i] if padded else sel_out
            base = 0 if padded else s
            if first_task[i] == t:  # the sample's rows without a selection, and its masks
                m = mask_out[i] if padded else mask_out[base : base + n]
                if padded:
                    rows[:s] = FILL
                    rows[s + r :] = FILL
                    m[:s] = True
                    m[s : s + r] = False
                    m[s + r :] = True
                    a = views[ATTENTION_MASK][i]
                    a[:s] = 0
                    a[s : s + n] = 1
                    a[s + n :] = 0
                else:
                    rows[base + r : base + n] = FILL
                    m[:r] = False
                    m[r:] = True
            lo_row = s if padded else base
            dst = rows[lo_row + r_lo : lo_row + r_hi]
            sels[i].write_layer(keep[ks[0]], dst[:, ks[0]], offset=s, rows=(r_lo, r_hi))
            for k in ks[1:]:
                dst[:, k] = dst[:, ks[0]]

    costs = [(r_hi - r_lo) * len(ks) + 1 for _i, ks, r_lo, r_hi in tasks]
    workers_ = _pool.default_workers() if memory.workers is None else memory.workers
    _pool.run(costs, write_tasks, workers_, sel_out.nbytes)
    return result
