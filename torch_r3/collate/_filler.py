"""Filler routes: what fills the token positions that have no captured route (`filler=`).

A filler route is `K` distinct experts (Megatron's dropless dispatcher needs
`tokens * topk` distinct assignments), except with `zeros` (every id 0, for
trainers that mask those rows themselves). `arange` uses `0 .. K-1` in every row;
`balanced` gives filler position `s` the experts `(s*K + j) % num_experts`,
where `s = g + p` for the trajectory's global row `g` and the position `p`
relative to its first token (negative in left padding). The filler of a
token therefore depends only on which trajectory it belongs to and where in
it, never on the other trajectories of the batch: a rank collating a subset
writes the same filler as the global batch. `FillerWriter` writes the filler of
any region with a few memcpys from a small cached template instead of
broadcasting a `[L, K]` row element by element.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from torch_r3._checks import check_choice, check_positive
from torch_r3._deprecation import renamed_argument

__all__ = ["FILLERS", "FillerWriter", "check_filler", "padding_rows"]

FILLERS = ("arange", "balanced", "zeros")
# Bytes of one cached padding template; a padding region of any length is
# filled by copying it chunk by chunk, so the cache stays small after a huge batch.
_TEMPLATE_BYTES = 256 << 10


def padding_rows(
    positions: Any,
    num_layers: int,
    topk: int,
    *,
    filler: str = "arange",
    num_experts: int | None = None,
    dtype: Any = np.uint8,
    padding: str | None = None,
) -> np.ndarray:
    """The padding routes of some token positions, `[len(positions), L, K]`.

    `arange` gives `0 .. K-1` in every row; `balanced` gives filler position
    `s` the experts `(s*K + j) % num_experts` for `j < K`, so that padding
    spreads over all experts. Every row of those two is `K` distinct experts,
    as Megatron's dropless dispatcher needs. `zeros` gives all zeros (what
    some trainers write and mask themselves): for `K > 1` no valid route, so
    never to be replayed. The collator uses `s = g + p`: the
    trajectory's global row `g` (`sample_ids`) plus the position `p` relative
    to the trajectory's first token (negative in left padding).

    Args:
        positions: filler positions `s` (any integer sequence, negative allowed).
        num_layers: `L`, the MoE layers.
        topk: `K`, the experts per token.
        filler: `"arange"`, `"balanced"` or `"zeros"`.
        num_experts: the model's expert count, for `"balanced"`.
        dtype: the NumPy dtype of the result.
        padding: deprecated spelling of `filler`.

    Returns:
        A new C-contiguous array `[len(positions), num_layers, topk]`.

    Examples:
        >>> padding_rows([0, 1], 1, 2, filler="balanced", num_experts=3)[:, 0]
        array([[0, 1],
               [2, 0]], dtype=uint8)
    """
    filler = renamed_argument(padding, filler, old="padding", new="filler", where="padding_rows", default="arange")
    num_experts = check_filler(filler, num_experts, topk)
    t = np.asarray(positions, dtype=np.int64).reshape(-1, 1)
    j = np.arange(topk, dtype=np.int64)
    if filler == "zeros":
        row = np.zeros((t.shape[0], topk), dtype=np.int64)
    elif filler == "arange" or num_experts is None:
        row = np.broadcast_to(j, (t.shape[0], topk))
    else:
        row = (t * topk + j) % num_experts
    return np.ascontiguousarray(np.broadcast_to(row[:, None, :], (t.shape[0], num_layers, topk)), dtype=dtype)


def check_filler(filler: str, num_experts: Any, topk: int) -> int | None:
    """`filler=` one of `FILLERS`, and `num_experts` as `"balanced"` needs it; returns `num_experts` checked."""
    check_choice(filler, "filler", FILLERS)
    if num_experts is not None:
        num_experts = check_positive(num_experts, "num_experts")
    if filler == "balanced":
        if num_experts is None:
            raise ValueError("filler='balanced' needs num_experts (the model's expert count)")
        if num_experts < topk:
            raise ValueError(
                f"filler='balanced' needs num_experts >= topk to give K distinct experts, "
                f"got num_experts={num_experts}, topk={topk}"
            )
    return num_experts


@functools.lru_cache(maxsize=8)
def _template(filler: str, num_experts: int | None, num_layers: int, topk: int, dtype_str: str):
    """A read-only block of padding rows from position 0, and the period it may be shifted by.

    The pattern repeats every `period` rows (1 for `arange`), so the padding of
    any region `[a, a+n)` is the template from row `a % period` on. The
    template holds a whole number of periods and about `_TEMPLATE_BYTES`; a
    period too long for that gives no template (rows computed per chunk).
    """
    row_bytes = num_layers * topk * np.dtype(dtype_str).itemsize
    period = 1 if filler != "balanced" or num_experts is None else num_experts // math.gcd(topk, num_experts)
    if period * row_bytes > _TEMPLATE_BYTES:
        return None, period
    rows = period * max(1, _TEMPLATE_BYTES // (period * row_bytes))
    tpl = padding_rows(
        np.arange(rows), num_layers, topk, filler=filler, num_experts=num_experts, dtype=np.dtype(dtype_str)
    )
    tpl.flags.writeable = False
    return tpl, period


class FillerWriter:
    """Writes the filler routes of positions `[start, start + n)` into a region of the token axis."""

    def __init__(self, filler: str, num_experts: int | None, num_layers: int, topk: int, dtype: np.dtype):
        self.args = (filler, num_experts, num_layers, topk)
        self.dtype = dtype
        self.tpl, self.period = _template(filler, num_experts, num_layers, topk, dtype.str)

    def __call__(self, dst: np.ndarray, start: int) -> None:
        n, done = dst.shape[0], 0
        # Reduced once: global row ids may be large, and int64 positions must not overflow.
        start %= self.period
        while done < n:
            if self.tpl is None:  # a very long balanced period: compute the rows
                m = min(n - done, 4096)
                filler, experts, layers, topk = self.args
                dst[done : done + m] = padding_rows(
                    np.arange(start + done, start + done + m) % self.period,
                    layers,
                    topk,
                    filler=filler,
                    num_experts=experts,
                    dtype=self.dtype,
                )
            else:
                o = (start + done) % self.period
                m = min(n - done, self.tpl.shape[0] - o)
                np.copyto(dst[done : done + m], self.tpl[o : o + m])
            done += m
