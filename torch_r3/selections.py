"""One trajectory's DSA indexer selections, stored compactly: `IndexerSelections`.

What a selection is. In DeepSeek Sparse Attention the lightning indexer of
each attention layer picks, for the query at position `j`, the `index_topk`
(`K`) positions it attends to among the `j + 1` it sees (itself included): a
set of `K` distinct positions in `[0, j]`. The dense form, as SGLang captures
it, is `[rows, layers, K]` `int32`, row `j` for the query at position `j`; a
query that sees `j + 1 <= K` positions selects every one of them, written
`0, 1, ..., j` and then `-1` in the `K - j - 1` unused slots.

The compact form exploits what these sets are:

* rows `j < K` select everything they see: nothing is stored for them;
* a stored row is a set, so its order is dropped; it is sorted and coded
  either as gaps, one byte per position (`p[i] - p[i-1] - 1`; the byte 255
  escapes to an exception list of `uint16`, or `uint32` when the sequence has
  more than 65536 positions), or as a bitmap of its `j + 1` visible positions,
  whichever is smaller for that row; one bit per row says which;
* a layer whose selections equal the layer before it (DSA's shared top-k
  layers, `index_topk_freq > 1`, which SGLang mirrors into every layer's slot)
  is stored once.

`IndexerSelections.from_dense` validates a dense array (each row's positions
in range, causal and distinct, the short rows exactly `0 .. j`) while it
encodes it, in bounded chunks of rows; `SelectionEncoder` is the same encoder
fed chunk by chunk (the SGLang decoder streams its payload into it).
`write_layer` decodes one layer straight into a caller's view, shifted by an
offset, which is how the collation writes every output byte once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from torch_r3._checks import check_integer_dtype, check_non_negative, check_positive

__all__ = ["FILL", "IndexerSelections", "SelectionEncoder"]

FILL = -1
"""The value of an unused selection slot (a query that sees fewer than `index_topk` positions)."""

ESCAPE = 255
"""The gap byte that says: the gap is the next entry of the exception list."""

# Rows handled per step: bounds the transient int32/int64 copies to a few tens of MiB.
_CHUNK_ELEMENTS = 1 << 22


def exception_dtype(rows: int) -> np.dtype:
    """The exception list's dtype for a trajectory of `rows` query rows: `uint16` while every gap fits."""
    return np.dtype(np.uint16) if rows <= 1 << 16 else np.dtype(np.uint32)


def _rows_per_chunk(topk: int) -> int:
    return max(1, _CHUNK_ELEMENTS // topk)


@functools.lru_cache(maxsize=4)
def _short_rows(topk: int) -> np.ndarray:
    """`[K, K]` `int32`: row `j` is `0 .. j` then `FILL`, the selection of a query that sees `j + 1 <= K` positions."""
    grid = np.arange(topk, dtype=np.int32)
    out = np.where(grid[None, :] <= grid[:, None], grid[None, :], FILL).astype(np.int32)
    out.setflags(write=False)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _LayerCode:
    """One stored layer: which rows are bitmaps, the gap bytes, their exceptions and the bitmaps."""

    is_bitmap: np.ndarray  # bool [rows - K]
    gaps: np.ndarray  # uint8 [delta rows * K]
    exceptions: np.ndarray  # uint16 / uint32
    bitmaps: np.ndarray  # uint8, row j takes (j + 8) // 8 bytes

    @property
    def nbytes(self) -> int:
        # The mode flags are counted packed, one bit per stored row.
        return (self.is_bitmap.size + 7) // 8 + self.gaps.nbytes + self.exceptions.nbytes + self.bitmaps.nbytes


class _LayerBuilder:
    """The growing code of one layer while chunks of rows arrive."""

    def __init__(self) -> None:
        self.is_bitmap: list[np.ndarray] = []
        self.gaps: list[np.ndarray] = []
        self.exceptions: list[np.ndarray] = []
        self.bitmaps: list[np.ndarray] = []

    def copy(self) -> _LayerBuilder:
        out = _LayerBuilder()
        out.is_bitmap, out.gaps = list(self.is_bitmap), list(self.gaps)
        out.exceptions, out.bitmaps = list(self.exceptions), list(self.bitmaps)
        return out

    def finish(self, exc_dtype: np.dtype) -> _LayerCode:
        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            out = np.concatenate(parts) if parts else np.empty(0, dtype)
            out = out.astype(dtype, copy=False)
            out.setflags(write=False)
            return out

        return _LayerCode(
            cat(self.is_bitmap, np.bool_),
            cat(self.gaps, np.uint8),
            cat(self.exceptions, exc_dtype),
            cat(self.bitmaps, np.uint8),
        )


def _encode_rows(sorted_rows: np.ndarray, first: int, exc_dtype: np.dtype, into: _LayerBuilder) -> None:
    """Code sorted, checked stored rows `first .. first + n - 1` (all `>= K`) into `into`."""
    n, topk = sorted_rows.shape
    gaps = np.empty_like(sorted_rows)
    gaps[:, 0] = sorted_rows[:, 0]
    np.subtract(sorted_rows[:, 1:], sorted_rows[:, :-1], out=gaps[:, 1:])
    gaps[:, 1:] -= 1
    big = gaps >= ESCAPE
    j = np.arange(first, first + n, dtype=np.int64)
    delta_cost = topk + big.sum(axis=1, dtype=np.int64) * exc_dtype.itemsize
    bitmap_cost = (j + 8) // 8
    as_bitmap = bitmap_cost < delta_cost
    into.is_bitmap.append(as_bitmap)
    delta = ~as_bitmap
    if delta.any():
        g = gaps[delta]
        into.gaps.append(np.minimum(g, ESCAPE).astype(np.uint8).reshape(-1))
        into.exceptions.append(g[g >= ESCAPE].astype(exc_dtype))
    if as_bitmap.any():
        p = sorted_rows[as_bitmap]
        widths = (j[as_bitmap] + 8) // 8  # bytes of each bitmap row
        # One boolean matrix as wide as the widest row, packed, then each row's own prefix kept:
        # row-major order makes the kept bytes the rows' bitmaps back to back.
        bits = np.zeros((p.shape[0], int(widths[-1]) * 8), dtype=np.bool_)
        bits[np.arange(p.shape[0])[:, None], p] = True
        packed = np.packbits(bits, axis=1, bitorder="little")
        into.bitmaps.append(packed[np.arange(packed.shape[1])[None, :] < widths[:, None]])


# Work per decoding step: bits unpacked (bitmap rows) or gaps summed (delta rows), sized so that a
# step's temporaries stay in a core's cache.
_BLOCK_BITS = 1 << 20
_BLOCK_GAPS = 1 << 18


def _bitmap_bytes(lo: int, hi: int) -> np.ndarray:
    """Bytes of the bitmaps of rows `lo .. hi - 1`, cumulative from 0 (`hi - lo + 1` entries)."""
    out = np.zeros(hi - lo + 1, dtype=np.int64)
    np.cumsum((np.arange(lo, hi, dtype=np.int64) + 8) // 8, out=out[1:])
    return out


class _StreamIndex:
    """Cumulative stream offsets of one layer code per stored row: where a decode may start mid-way."""

    def __init__(self, code: _LayerCode, topk: int) -> None:
        mode = code.is_bitmap
        n = mode.size
        self.bitmap_rows = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(mode, out=self.bitmap_rows[1:])
        widths = np.where(mode, (np.arange(topk, topk + n, dtype=np.int64) + 8) // 8, 0)
        self.bitmap_bytes = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(widths, out=self.bitmap_bytes[1:])
        delta_rows = n - int(self.bitmap_rows[-1])
        escapes = np.zeros(delta_rows, dtype=np.int64)
        step = _rows_per_chunk(topk)
        for lo in range(0, delta_rows, step):
            hi = min(delta_rows, lo + step)
            gaps = code.gaps[lo * topk : hi * topk].reshape(hi - lo, topk)
            escapes[lo:hi] = np.count_nonzero(gaps == ESCAPE, axis=1)
        self.escapes = np.zeros(delta_rows + 1, dtype=np.int64)
        np.cumsum(escapes, out=self.escapes[1:])
        self.topk = topk

    def at(self, stored: int) -> tuple[int, int, int]:
        """`(gap byte, exception, bitmap byte)` offsets of stored row `stored`."""
        bitmaps = int(self.bitmap_rows[stored])
        deltas = stored - bitmaps
        return deltas * self.topk, int(self.escapes[deltas]), int(self.bitmap_bytes[stored])


def _decode_stored(
    code: _LayerCode, topk: int, lo: int, hi: int, out: np.ndarray, offset: int, cursors: tuple[int, int, int]
) -> None:
    """Decode stored rows `lo .. hi - 1` (all `>= topk`) into `out` `[hi - lo, topk]`, shifted by `offset`.

    Runs of rows in one mode are decoded in blocks, each written straight into
    its rows of `out`: a bitmap block is one `unpackbits` and one
    `flatnonzero` (the set bits, in order, are the rows' positions back to
    back); a delta block is one cumulative sum over all its gap rows (the
    escaped gaps added back afterwards, row by row, as corrections).
    """
    K = topk
    g_at, e_at, b_at = cursors
    mode = code.is_bitmap[lo - K : hi - K]
    edges = [0, *(np.flatnonzero(mode[1:] != mode[:-1]) + 1).tolist(), hi - lo]
    # `p[i] = sum(gaps[:i + 1]) + i`, shifted: `i + offset <= p[i] + offset` fits wherever `p` does.
    ramp = (np.arange(K, dtype=np.int64) + offset).astype(out.dtype)
    for a, b in zip(edges[:-1], edges[1:]):
        if mode[a]:
            first = lo + a
            block = max(1, _BLOCK_BITS // (lo + b + 8))  # rows per step: the widest row bounds its bits
            for r0 in range(first, lo + b, block):
                r1 = min(lo + b, r0 + block)
                starts = _bitmap_bytes(r0, r1)
                nbytes = int(starts[-1])
                bits = np.unpackbits(code.bitmaps[b_at : b_at + nbytes], bitorder="little").view(np.bool_)
                b_at += nbytes
                found = np.flatnonzero(bits)
                if found.size != (r1 - r0) * K:
                    raise ValueError(f"indexer selections: corrupt bitmap code in rows {r0}..{r1 - 1}")
                starts *= 8
                starts -= offset
                np.subtract(found.reshape(r1 - r0, K), starts[:-1, None], out=out[r0 - lo : r1 - lo], casting="unsafe")
            continue
        block = max(1, _BLOCK_GAPS // K)
        for r0 in range(lo + a, lo + b, block):
            r1 = min(lo + b, r0 + block)
            n = (r1 - r0) * K
            gaps = code.gaps[g_at : g_at + n].reshape(r1 - r0, K)
            g_at += n
            dst = out[r0 - lo : r1 - lo]
            np.cumsum(gaps, axis=1, dtype=dst.dtype, out=dst)
            np.add(dst, ramp, out=dst, casting="unsafe")
            escaped = np.flatnonzero(gaps.reshape(-1) == ESCAPE)
            if escaped.size:  # each escaped gap counted 255: add the rest from there to its row's end
                extra = code.exceptions[e_at : e_at + escaped.size].astype(np.int64) - ESCAPE
                e_at += escaped.size
                row, col = np.divmod(escaped, K)
                rows, which = np.unique(row, return_inverse=True)
                fix = np.zeros((rows.size, K), dtype=np.int64)
                fix[which, col] = extra
                np.cumsum(fix, axis=1, out=fix)
                fix += dst[rows]
                dst[rows] = fix


class SelectionEncoder:
    """Encode one trajectory's dense selections chunk by chunk, checking every row.

    Args:
        rows: The query rows the trajectory will have in all.
        num_layers: Layers per row.
        index_topk: Positions each query selects (`K`).
        name: What to call the data in error messages (a field or a sample).

    Feed consecutive chunks `[r, num_layers, K]` with `add`, then call `finish`.

    Examples:
        >>> import numpy as np
        >>> enc = SelectionEncoder(rows=3, num_layers=1, index_topk=2)
        >>> enc.add(np.array([[[0, -1]], [[0, 1]], [[2, 0]]]))
        >>> enc.finish().to_dense().tolist()
        [[[0, -1]], [[0, 1]], [[0, 2]]]
    """

    def __init__(self, *, rows: int, num_layers: int, index_topk: int, name: str = "indexer_topk") -> None:
        self.rows = check_non_negative(rows, "rows")
        self.num_layers = check_positive(num_layers, "num_layers")
        self.index_topk = check_positive(index_topk, "index_topk")
        self.name = name
        self._exc_dtype = exception_dtype(self.rows)
        self._next = 0
        # shared[l]: layer l has equalled layer l - 1 on every row so far.
        self._shared = [False] + [True] * (self.num_layers - 1)
        self._layers: list[_LayerBuilder | None] = [_LayerBuilder()] + [None] * (self.num_layers - 1)

    def add(self, chunk: Any) -> None:
        """Check and encode the next rows: a `[r, num_layers, index_topk]` integer array."""
        chunk = np.asarray(chunk)
        check_integer_dtype(chunk, self.name)
        L, K = self.num_layers, self.index_topk
        if chunk.ndim != 3 or chunk.shape[1:] != (L, K):
            raise ValueError(
                f"{self.name}: expected rows of [num_layers={L}, index_topk={K}], got shape {list(chunk.shape)}"
            )
        first, n = self._next, chunk.shape[0]
        if first + n > self.rows:
            raise ValueError(f"{self.name}: more than the {self.rows} rows announced")
        step = _rows_per_chunk(K)
        for lo in range(0, n, step):
            self._add(chunk[lo : lo + step], first + lo)
        self._next = first + n

    def _source(self, layer: int) -> int:
        while self._shared[layer]:
            layer -= 1
        return layer

    def _add(self, chunk: np.ndarray, first: int) -> None:
        n, L, K = chunk.shape
        short = max(0, min(first + n, K) - first)  # rows j < K in this chunk
        flips = [
            layer
            for layer in range(1, L)
            if self._shared[layer] and not np.array_equal(chunk[:, layer], chunk[:, layer - 1])
        ]
        # A layer that differs from here on: its code so far is its source's (copied before this
        # chunk is coded), then its own.
        copies = {layer: self._layers[self._source(layer - 1)] for layer in flips}
        for layer, src in copies.items():
            assert src is not None
            self._shared[layer] = False
            self._layers[layer] = src.copy()
        for layer in range(L):
            if self._shared[layer]:
                continue  # equal to the layer before on every row: checked and coded there
            if short:
                self._check_short(chunk[:short, layer], first, layer)
            if short < n:
                sorted_rows = self._checked_sorted(chunk[short:, layer], first + short, layer)
                builder = self._layers[layer]
                assert builder is not None
                _encode_rows(sorted_rows, first + short, self._exc_dtype, builder)

    def _check_short(self, rows: np.ndarray, first: int, layer: int) -> None:
        want = _short_rows(self.index_topk)[first : first + rows.shape[0]]
        got = np.sort(rows, axis=1)
        # Sorted, the FILL slots come first: compare with the template sorted the same way.
        expect = np.sort(want, axis=1)
        bad = np.flatnonzero((got != expect).any(axis=1))
        if bad.size:
            j = first + int(bad[0])
            raise ValueError(
                f"{self.name}: layer {layer}, query position {j} sees {j + 1} <= index_topk={self.index_topk} "
                f"positions and must select all of 0..{j} (and -1 in the other slots), "
                f"got {rows[int(bad[0])][: min(8, self.index_topk)].tolist()}..."
            )

    def _checked_sorted(self, rows: np.ndarray, first: int, layer: int) -> np.ndarray:
        wide = rows.astype(np.int64) if rows.dtype.itemsize > 4 or rows.dtype == np.uint32 else rows
        srt = np.sort(wide, axis=1)
        j = np.arange(first, first + srt.shape[0], dtype=np.int64)
        low, high = srt[:, 0], srt[:, -1]
        dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1) if srt.shape[1] > 1 else np.zeros(srt.shape[0], bool)
        bad = (low < 0) | (high > j) | dup
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            q = first + r
            if low[r] < 0:
                what = f"holds {int(low[r])} (positions are >= 0)"
            elif high[r] > q:
                what = f"selects position {int(high[r])}, after the query itself (not causal)"
            else:
                what = "selects a position twice"
            raise ValueError(f"{self.name}: layer {layer}, query position {q} {what}")
        return srt.astype(np.int32, copy=False)

    def finish(self) -> IndexerSelections:
        """The compact selections; every announced row must have been added."""
        if self._next != self.rows:
            raise ValueError(f"{self.name}: {self._next} rows added, {self.rows} announced")
        source = tuple(self._source(layer) for layer in range(self.num_layers))
        codes = {layer: b.finish(self._exc_dtype) for layer, b in enumerate(self._layers) if b is not None}
        if len(codes) != len(set(source)):  # layers whose code was never needed
            codes = {layer: codes[layer] for layer in set(source)}
        return IndexerSelections(self.rows, self.index_topk, source, codes)


class IndexerSelections:
    """One trajectory's indexer selections in compact form (see the module docstring).

    Build one with `from_dense` (or `torch_r3.indexer.decode_sglang_indexer_topk`);
    it is immutable, pickles (for `DataLoader` workers and Ray) and knows its
    sizes.

    Attributes:
        rows: Query rows (the trajectory's captured prefix, like route rows).
        index_topk: Positions each query selects.
        layer_source: For each layer, the layer whose stored code it uses
            (itself, or an earlier layer it equals).

    Examples:
        >>> import numpy as np
        >>> dense = np.array([[[0, -1]], [[0, 1]], [[2, 0]], [[3, 1]]])
        >>> sel = IndexerSelections.from_dense(np.repeat(dense, 3, axis=1))
        >>> sel.shape, sel.layer_source
        ((4, 3, 2), (0, 0, 0))
        >>> sel.to_dense()[:, 2].tolist()
        [[0, -1], [0, 1], [0, 2], [1, 3]]
    """

    def __init__(self, rows: int, index_topk: int, layer_source: tuple[int, ...], codes: dict[int, _LayerCode]):
        self.rows = rows
        self.index_topk = index_topk
        self.layer_source = layer_source
        self._codes = codes
        # Per layer code: where each stored row starts in its streams (built when first needed, not pickled).
        self._index: dict[int, _StreamIndex] = {}

    @classmethod
    def from_dense(cls, array: Any, *, name: str = "indexer_topk") -> IndexerSelections:
        """Check and compact a dense `[rows, layers, index_topk]` integer array (NumPy or a CPU tensor).

        Raises:
            TypeError: not an integer array.
            ValueError: not 3-D, or a row is not a valid selection: a position
                negative, after its query or repeated, or a short row
                (`j < index_topk`) that is not exactly `0 .. j` and `-1`.
        """
        if hasattr(array, "detach"):
            array = array.detach().cpu().numpy()
        array = np.asarray(array)
        check_integer_dtype(array, name)
        if array.ndim != 3 or 0 in array.shape[1:]:
            raise ValueError(f"{name}: expected a [rows, layers, index_topk] array, got shape {list(array.shape)}")
        enc = SelectionEncoder(rows=array.shape[0], num_layers=array.shape[1], index_topk=array.shape[2], name=name)
        enc.add(array)
        return enc.finish()

    @property
    def num_layers(self) -> int:
        return len(self.layer_source)

    @property
    def shape(self) -> tuple[int, int, int]:
        """`(rows, layers, index_topk)`, the dense shape."""
        return (self.rows, self.num_layers, self.index_topk)

    @property
    def stored_layers(self) -> tuple[int, ...]:
        """The layers that hold their own code (the others equal the layer before them)."""
        return tuple(sorted(self._codes))

    @property
    def nbytes(self) -> int:
        """Bytes of the compact form (codes and the per-layer map)."""
        return sum(code.nbytes for code in self._codes.values()) + self.num_layers

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the same selections as SGLang's dense `int32`."""
        return self.rows * self.num_layers * self.index_topk * 4

    def __repr__(self) -> str:
        return (
            f"IndexerSelections(rows={self.rows}, layers={self.num_layers}, index_topk={self.index_topk}, "
            f"stored_layers={len(self._codes)}, nbytes={self.nbytes})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (IndexerSelections, (self.rows, self.index_topk, self.layer_source, self._codes))

    def write_layer(self, layer: int, out: np.ndarray, offset: int = 0, rows: tuple[int, int] | None = None) -> None:
        """Write layer `layer`'s `[rows, index_topk]` positions, plus `offset`, into `out`.

        Unused slots get `FILL` (`-1`), unshifted; each row's positions come
        out sorted. `out` may be any signed integer view (a slice of a batch
        tensor) that holds every shifted position; each of its elements is
        written once. `rows=(lo, hi)` writes only query rows `lo .. hi - 1`
        (then `out` is `[hi - lo, index_topk]`), so that threads can share one
        long trajectory.
        """
        code = self._codes[self.layer_source[layer]]
        K = self.index_topk
        lo, hi = (0, self.rows) if rows is None else rows
        if not 0 <= lo <= hi <= self.rows:
            raise ValueError(f"rows: expected 0 <= lo <= hi <= {self.rows}, got {(lo, hi)}")
        if out.shape != (hi - lo, K):
            raise ValueError(f"out: expected shape [{hi - lo}, {K}], got {list(out.shape)}")
        short = max(0, min(hi, K) - lo)
        if short:
            tmpl = _short_rows(K)[lo : lo + short]
            np.add(tmpl, offset, out=out[:short], casting="unsafe")
            out[:short][tmpl < 0] = FILL
        first = max(lo, K)
        if first < hi:
            _decode_stored(code, K, first, hi, out[first - lo :], offset, self._cursors(code, first))

    def _cursors(self, code: _LayerCode, row: int) -> tuple[int, int, int]:
        """Where stored row `row` starts in the gap, exception and bitmap streams of `code`."""
        if row == self.index_topk:
            return 0, 0, 0
        index = self._index.get(id(code))
        if index is None:  # built once per layer code, the first time a decode starts mid-way
            index = self._index[id(code)] = _StreamIndex(code, self.index_topk)
        return index.at(row - self.index_topk)

    def differing_rows(self, other: IndexerSelections, rows: int) -> np.ndarray:
        """The rows among `0 .. rows - 1` where `other` selects another set in any layer (sorted `int64`).

        Both must have the same layers and `index_topk` and at least `rows`
        rows. Equal rows usually have equal codes, which are compared as
        bytes; only a layer whose codes differ is decoded, piece by piece (the
        same set can be coded two ways when the row counts put the exception
        lists in different dtypes).

        Examples:
            >>> import numpy as np
            >>> a = IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 0]]]))
            >>> b = IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 1]], [[3, 0]]]))
            >>> a.differing_rows(b, 2).tolist(), a.differing_rows(b, 3).tolist()
            ([], [2])
        """
        if (other.num_layers, other.index_topk) != (self.num_layers, self.index_topk):
            raise ValueError(
                f"selections of [layers={other.num_layers}, index_topk={other.index_topk}], expected "
                f"[{self.num_layers}, {self.index_topk}]"
            )
        if not 0 <= rows <= min(self.rows, other.rows):
            raise ValueError(f"rows: expected 0 <= rows <= {min(self.rows, other.rows)}, got {rows}")
        K = self.index_topk
        differs = np.zeros(max(0, rows - K), dtype=np.bool_)  # short rows are exactly 0 .. j on arrival
        step = _rows_per_chunk(K)
        for layer in range(self.num_layers):
            mine, theirs = self._codes[self.layer_source[layer]], other._codes[other.layer_source[layer]]
            if rows <= K or self._same_code(mine, other, theirs, rows):
                continue
            a = np.empty((min(step, rows - K), K), dtype=np.int32)
            b = np.empty_like(a)
            for lo in range(K, rows, step):
                hi = min(rows, lo + step)
                self.write_layer(layer, a[: hi - lo], rows=(lo, hi))
                other.write_layer(layer, b[: hi - lo], rows=(lo, hi))
                differs[lo - K : hi - K] |= (a[: hi - lo] != b[: hi - lo]).any(axis=1)
        return np.flatnonzero(differs) + K

    def _same_code(self, mine: _LayerCode, other: IndexerSelections, theirs: _LayerCode, rows: int) -> bool:
        stored = rows - self.index_topk
        if not np.array_equal(mine.is_bitmap[:stored], theirs.is_bitmap[:stored]):
            return False
        g, e, b = self._cursors(mine, rows)
        return (
            (g, e, b) == other._cursors(theirs, rows)
            and np.array_equal(mine.gaps[:g], theirs.gaps[:g])
            and np.array_equal(mine.exceptions[:e], theirs.exceptions[:e])
            and np.array_equal(mine.bitmaps[:b], theirs.bitmaps[:b])
        )

    def to_dense(self, dtype: Any = np.int32, layers: Sequence[int] | None = None) -> np.ndarray:
        """The dense `[rows, layers, index_topk]` array, rows sorted, `-1` in unused slots."""
        keep = range(self.num_layers) if layers is None else list(layers)
        out = np.empty((self.rows, len(keep), self.index_topk), dtype=dtype)
        for i, layer in enumerate(keep):
            self.write_layer(layer, out[:, i])
        return out
