"""The health check's passes over one route array, on packed machine words.

A route array `[rows, layers, topk]` of small integers is read as words: each
row's bytes as `W` unsigned words (`uint64` where the row's width allows), and
each layer's `topk` ids as `k` words of their own (one `uint64` for top-8
`uint8` ids). The questions the health check asks become a few word compares
per row instead of byte-wide passes with full-width boolean temporaries:

- which rows are zero in every layer, or in one layer (`zero_rows`,
  `layer_zero_rows`): a row hash that is not zero, or a column that is never
  zero, already says "none"; only candidates are checked exactly;
- which layers hold one row throughout (`same_as_first`): rows compared with
  the first over a short prefix, then the few layers still equal over the rest;
- which rows repeat the one before (`repeats`): consecutive row hashes compared,
  and only equal hashes checked row against row.

Every answer is exact: the hashes only pick candidates, which are confirmed on
the words themselves. `row_hashes` is the replayed-rows memory's per-row
fingerprint (`torch_r3.health._row_memory`), which no row data confirms: the word
hash plus a term for the words' high halves, so that rows differing in any
structured way collide for about one pair in 2**32. Both are functions of the ids
alone, so a row hashes alike in a `uint8` and an `int16` array. NumPy only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RouteScan"]

# Rows compared with the first before the layers still equal to it are checked over the rest.
_PREFIX_ROWS = 64
_MIX = np.uint64(0x9E3779B97F4A7C15)
_SEED = 0x52335F  # fixed: row hashes must agree across calls and processes


def _words(flat: np.ndarray, width: int) -> np.ndarray:
    """`flat` (`[rows, width]` bytes, C-contiguous) as the widest unsigned words that divide `width`."""
    for size in (8, 4, 2):
        if width % size == 0:
            return flat.view(f"<u{size}")
    return flat


class RouteScan:
    """One route array, read as packed words; each question is answered once, when first asked.

    Args:
        routes: An integer array `[rows, layers, topk]` (any byte order, any strides).
    """

    def __init__(self, routes: np.ndarray) -> None:
        a = routes if routes.flags.c_contiguous and routes.dtype.isnative else np.ascontiguousarray(routes)
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        self.routes = a
        self.rows, self.layers, self.topk = a.shape
        cell = self.topk * a.dtype.itemsize
        raw = a.view(np.uint8).reshape(self.rows, self.layers * cell)
        self.row_words = _words(raw, raw.shape[1])  # [rows, W]
        per_layer = _words(raw, cell)
        k = cell // per_layer.dtype.itemsize
        self.layer_words = per_layer.reshape(self.rows, self.layers, k)  # [rows, layers, k]
        self._row_zero: np.ndarray | None = None
        self._row_hashes: np.ndarray | None = None
        self._linear: np.ndarray | None = None
        self._planes: list[np.ndarray] | None = None

    def row_hashes(self) -> np.ndarray:
        """The replayed-rows memory's fingerprint of each full row (every layer), `uint64 [rows]`; zero for a zero row.

        A multilinear hash of the row's 32-bit halves, `sum_j lo_j * a_j + hi_j * b_j mod 2**64`
        over the ids' byte planes, computed as the word hash `sum_j word_j * m_j` (`a_j = m_j`)
        plus `sum_j (word_j >> 32) * n_j` (`b_j = 2**32 m_j + n_j`), then mixed. A difference
        `d * 2**t` (`d` odd, `t < 32`) in a half keeps at least 32 random bits of its
        multiplier, so rows that differ collide for about one pair in 2**32, whatever the
        structure of the difference. The word hash alone kept only the top 8 bits of the
        multiplier for a difference in a word's top byte (the 8th of top-8 `uint8` ids): two
        such differences cancelled for one choice in 256. The other passes, whose candidates
        are confirmed on the words, use the word hash alone.
        """
        if self._row_hashes is None:
            total = self._linear_hashes().copy()
            with np.errstate(over="ignore"):
                for words, (_, high) in zip(self._plane_words(), self._plane_multipliers()):
                    total += np.einsum("ij,j->i", words >> np.uint64(32), high)
                self._row_hashes = (total ^ (total >> np.uint64(29))) * _MIX
        return self._row_hashes

    def zero_rows(self) -> np.ndarray:
        """Which rows are zero in every layer, `bool [rows]`."""
        if self._row_zero is None:
            zero = np.zeros(self.rows, bool)
            if self._linear is not None:
                candidates = np.flatnonzero(self._linear == 0)  # a zero row hashes to zero
            elif self.rows and self._never_zero_column():
                candidates = np.empty(0, np.intp)
            else:
                candidates = np.flatnonzero(np.bitwise_or.reduce(self.row_words, axis=1) == 0)
            if candidates.size:
                zero[candidates] = ~self.row_words[candidates].any(axis=1)
            self._row_zero = zero
        return self._row_zero

    def layer_zero_rows(self, layer: int) -> np.ndarray:
        """Which rows are zero in `layer`, `bool [rows]`."""
        words = self.layer_words[:, layer]
        return np.asarray(~words.any(axis=1))

    def zero_candidate_layers(self) -> np.ndarray:
        """Layers that may hold a zero row (each of their words is zero in some row), `bool [layers]`.

        A layer outside this set has no zero row; one inside is checked with `layer_zero_rows`.
        """
        if not self.rows:
            return np.zeros(self.layers, bool)
        return np.asarray((self.layer_words == 0).any(axis=0).all(axis=1))

    def same_as_first(self) -> np.ndarray:
        """Which layers hold their first row in every row, `bool [layers]`."""
        words = self.layer_words
        head = words[1:_PREFIX_ROWS]
        same = ~(head != words[0]).any(axis=(0, 2)) if head.shape[0] else np.ones(self.layers, bool)
        candidates = np.flatnonzero(same)
        if candidates.size and self.rows > _PREFIX_ROWS:
            tail = words[_PREFIX_ROWS:, candidates] if candidates.size < self.layers else words[_PREFIX_ROWS:]
            same[candidates] = ~(tail != words[0, candidates]).any(axis=(0, 2))
        return np.asarray(same)

    def repeats(self) -> np.ndarray:
        """Whether row `i + 1` equals row `i`, `bool [rows - 1]`."""
        h = self._linear_hashes()
        out = np.zeros(max(self.rows - 1, 0), bool)
        candidates = np.flatnonzero(h[1:] == h[:-1])
        if candidates.size:
            words = self.row_words
            out[candidates] = (words[candidates + 1] == words[candidates]).all(axis=1)
        return out

    def _never_zero_column(self) -> bool:
        """A row word that is non-zero in every row (then no row is zero); tries a few columns of row 0."""
        first = np.flatnonzero(self.row_words[0])
        return any(bool(self.row_words[:, c].all()) for c in first[:4].tolist())

    def _linear_hashes(self) -> np.ndarray:
        """Per row, `sum_j word_j * m_j mod 2**64` over the ids' byte planes (zero planes add nothing).

        Equal rows hash alike and a zero row hashes to zero: the candidates of `repeats` and
        `zero_rows`, confirmed on the words (`row_hashes` adds what the memory needs).
        """
        if self._linear is None:
            total = np.zeros(self.rows, np.uint64)
            with np.errstate(over="ignore"):
                for words, (low, _) in zip(self._plane_words(), self._plane_multipliers()):
                    # einsum: NumPy's integer matmul is slower for this matrix-vector product.
                    total += np.einsum("ij,j->i", words, low)
            self._linear = total
        return self._linear

    def _plane_words(self) -> list[np.ndarray]:
        """The ids' byte planes (low byte first, while any id has more), each row as `uint64` words."""
        if self._planes is None:
            a = self.routes.reshape(self.rows, self.layers * self.topk)
            width = a.shape[1]
            padded = -(-width // 8) * 8
            if a.dtype == np.uint8:
                planes = [a]
            else:
                v = a.astype(np.uint64) if a.dtype.kind == "u" else a.astype(np.int64).view(np.uint64)
                planes = []
                shift = 0
                while shift < 64 and (shift == 0 or v.any()):
                    planes.append((v & np.uint64(0xFF)).astype(np.uint8))
                    v = v >> np.uint64(8)
                    shift += 8
            out = []
            for plane in planes:
                if padded != width:
                    wide = np.zeros((self.rows, padded), np.uint8)
                    wide[:, :width] = plane
                    plane = wide
                out.append(np.ascontiguousarray(plane).view("<u8"))
            self._planes = out
        return self._planes

    def _plane_multipliers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [_multipliers(words.shape[1], p) for p, words in enumerate(self._plane_words())]


_MULTIPLIERS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _multipliers(width: int, plane: int) -> tuple[np.ndarray, np.ndarray]:
    """Random 64-bit multipliers `(m, n)` for `width` words of byte plane `plane` (fixed per width and plane).

    `m` (odd) multiplies each whole word, `n` its high 32-bit half: see `RouteScan.row_hashes`.
    """
    key = (width, plane)
    m = _MULTIPLIERS.get(key)
    if m is None:
        rng = np.random.default_rng([_SEED, width, plane])
        low = rng.integers(0, 1 << 63, width, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        high = rng.integers(0, 1 << 64, width, dtype=np.uint64)
        m = _MULTIPLIERS[key] = (low, high)
    return m
