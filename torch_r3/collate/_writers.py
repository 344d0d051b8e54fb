"""The collation kernel's two writers: each byte of a batch written once, row by row.

`collate_routes` checks everything, allocates the outputs and then hands the
copy threads (`torch_r3.collate._pool`) one of these writers. Each returns the cost of
every sample (for the pool's balancing) and `write_rows(lo, hi)`, which writes
samples `lo .. hi-1` completely: their routes, filler rows, masks and
per-token fields, every byte of their region of the output once.

* `padded_writer`: `[B, T, ...]` with each sample's real tokens at
  `[starts[i], starts[i] + n_i)`: left padding (`starts[i] = T - n_i`), right
  padding (`0`) and the prompt-left/response-right layout
  (`prompt_width - p_i`) are the same writer with other starts.
* `packed_writer`: `[sum(n'), ...]`, sample `i` at
  `[offsets[i], offsets[i] + n_i)` followed by its alignment rows up to
  `offsets[i + 1]` (none without `pad_to_multiple_of`).

Filler rows are keyed by the sample's global row and the position from its
first token (negative before it), so a subset of the batch gets the global
batch's filler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from torch_r3.collate._filler import FillerWriter
from torch_r3.collate._samples import SeqField
from torch_r3.keys import ATTENTION_MASK, ROUTER_MASK, ROUTES

__all__ = ["packed_writer", "padded_writer"]

RowCopier = Callable[[np.ndarray, np.ndarray], None]
Writer = tuple[list[int], Callable[[int, int], None]]


def padded_writer(
    views: dict[str, np.ndarray],
    arrays: Sequence[np.ndarray],
    counts: Sequence[int],
    starts: Sequence[int],
    ids: Sequence[int],
    fill_pad: FillerWriter,
    copy_rows: RowCopier,
    fields: Sequence[SeqField],
) -> Writer:
    """The writer of a `[B, T, ...]` batch whose sample `i` holds positions `[starts[i], starts[i] + counts[i])`."""
    routes_out, mask_out, att_out = views[ROUTES], views[ROUTER_MASK], views[ATTENTION_MASK]
    T = routes_out.shape[1]
    fviews = [(views[f.key], f.arrays, f.pad) for f in fields]

    def write_rows(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            s = starts[i]  # first real token
            n = s + counts[i]  # end of the real tokens
            e = s + arrays[i].shape[0]  # end of the captured rows
            dst = routes_out[i]
            fill_pad(dst[:s], ids[i] - s)
            copy_rows(dst[s:e], arrays[i])
            fill_pad(dst[e:], ids[i] + arrays[i].shape[0])
            m = mask_out[i]
            m[:s] = True
            m[s:e] = False
            m[e:] = True
            a = att_out[i]
            a[:s] = 0
            a[s:n] = 1
            a[n:] = 0
            for fo, fa, pad in fviews:
                fo[i, :s] = pad
                fo[i, s:n] = fa[i]
                fo[i, n:] = pad

    return [T] * len(arrays), write_rows


def packed_writer(
    views: dict[str, np.ndarray],
    arrays: Sequence[np.ndarray],
    counts: Sequence[int],
    offsets: np.ndarray,
    ids: Sequence[int],
    fill_pad: FillerWriter,
    copy_rows: RowCopier,
    fields: Sequence[SeqField],
) -> Writer:
    """The writer of a packed batch: sample `i`'s tokens from `offsets[i]`, alignment rows to `offsets[i + 1]`."""
    routes_out, mask_out = views[ROUTES], views[ROUTER_MASK]
    fviews = [(views[f.key], f.arrays, f.pad) for f in fields]

    def write_rows(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            c, end, n, r = int(offsets[i]), int(offsets[i + 1]), counts[i], arrays[i].shape[0]
            copy_rows(routes_out[c : c + r], arrays[i])
            fill_pad(routes_out[c + r : end], ids[i] + r)
            mask_out[c : c + r] = False
            mask_out[c + r : end] = True
            for fo, fa, pad in fviews:
                fo[c : c + n] = fa[i]
                fo[c + n : end] = pad

    return [int(offsets[i + 1] - offsets[i]) for i in range(len(arrays))], write_rows
