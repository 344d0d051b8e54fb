"""`TokenMetadataTrace`: per-token rows appended in chunks, finalized into one array.

The row store `torch_r3.rollout.trace.RoutedExpertTrace` is built on: every chunk is
checked (an integer array of the store's row shape, the rows a turn promised)
before it is kept, and `finalize` writes them once into one array of the widest
dtype appended. Not offered to users (not in `torch_r3`'s `__all__`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_r3._checks import check_integer_dtype, check_non_negative
from torch_r3.routes import CANONICAL_DTYPES, as_host_array, compact_routes, is_canonical, widest

__all__ = ["TokenMetadataTrace"]


class TokenMetadataTrace:
    """Token-aligned integer rows, appended in chunks and finalized into one array.

    Each chunk is `[n, *row_shape]` of a canonical dtype (`uint8`, `int16`,
    `int32`); a chunk of another integer dtype is compacted on arrival, which
    scans it once. When a later chunk needs a wider dtype than earlier ones, the
    result is widened losslessly (by dtype alone) at `finalize`, so a
    rollout whose expert ids pass 255 in a later turn just works.

    Args:
        row_shape: The shape of one row (for routes `(layers, topk)`); taken
            from the first chunk when `None`.
        name: What to call the trace in error messages.

    Examples:
        >>> import numpy as np
        >>> t = TokenMetadataTrace(row_shape=(1, 2))
        >>> t.append(np.array([[[1, 2]]], dtype=np.uint8))
        >>> t.append(np.array([[[300, 4]], [[5, 6]]], dtype=np.int16))
        >>> out = t.finalize()
        >>> out.dtype, out.tolist()
        (dtype('int16'), [[[1, 2]], [[300, 4]], [[5, 6]]])
    """

    def __init__(self, *, row_shape: tuple[int, ...] | None = None, name: str = "trace") -> None:
        if row_shape is not None:
            if not isinstance(row_shape, (tuple, list)):
                raise TypeError(f"{name}: row_shape must be a tuple of ints, got {type(row_shape).__name__}")
            row_shape = tuple(check_non_negative(d, f"{name}: row_shape[{i}]") for i, d in enumerate(row_shape))
        self._name = name
        self._row_shape: tuple[int, ...] | None = row_shape
        self._chunks: list[np.ndarray] = []
        self._rows = 0

    @property
    def rows(self) -> int:
        """Rows appended so far."""
        return self._rows

    @property
    def row_shape(self) -> tuple[int, ...] | None:
        """The shape of one row, or `None` before the first chunk when not given."""
        return self._row_shape

    @property
    def dtype(self) -> np.dtype | None:
        """The widest dtype appended so far (the dtype `finalize` returns)."""
        return widest(c.dtype for c in self._chunks) if self._chunks else None

    def append(self, chunk: Any, *, expected_rows: int | None = None, label: str | None = None) -> None:
        """Append `[n, *row_shape]` rows.

        The trace keeps a reference to `chunk` (no copy) when it already has a
        canonical dtype; do not modify it afterwards.

        Args:
            chunk: A NumPy array, `torch.Tensor` or tensor-like of an integer dtype.
            expected_rows: When given, `chunk` must hold exactly this many rows.
            label: What to call this chunk in error messages (default
                `"<name>: chunk <i>"`).

        Raises:
            TypeError: `chunk` is not an integer array or tensor.
            ValueError: wrong row count or row shape, or a negative or too large
                value in a chunk that needs compacting. A chunk with no rows is
                checked against a known row shape but otherwise ignored: it
                neither fixes the row shape nor widens the dtype.
        """
        what = label if label is not None else f"{self._name}: chunk {len(self._chunks)}"
        if expected_rows is not None:
            expected_rows = check_non_negative(expected_rows, f"{what}: expected_rows")
        array = _as_rows(chunk, what)
        if array.ndim < 1:
            raise ValueError(f"{what}: expected an array [rows, ...], got a 0-d array")
        row_shape = tuple(array.shape[1:])
        if self._row_shape is not None and row_shape != self._row_shape:
            raise ValueError(f"{what}: expected rows of shape {self._row_shape}, got {row_shape}")
        if expected_rows is not None and array.shape[0] != expected_rows:
            raise ValueError(f"{what}: expected {expected_rows} rows, got {array.shape[0]}")
        if array.shape[0] == 0:
            # No rows, no evidence: an empty chunk may claim any row shape or
            # dtype, so it neither fixes the row shape nor widens the result.
            return
        self._row_shape = row_shape
        self._chunks.append(array)
        self._rows += array.shape[0]

    def finalize(self) -> np.ndarray:
        """All rows appended so far as one new C-contiguous array of the widest dtype.

        The trace is left as it is; calling again returns an equal, new array.

        Raises:
            ValueError: nothing was appended and `row_shape` was not given.
        """
        if not self._chunks:
            if self._row_shape is None:
                raise ValueError(f"{self._name}: no rows appended and row_shape unknown; pass row_shape")
            return np.empty((0, *self._row_shape), dtype=CANONICAL_DTYPES[0])
        # casting="safe" makes the widening provably lossless: uint8 -> int16
        # -> int32 only, chosen by dtype, never by looking at the values.
        return np.concatenate(self._chunks, axis=0, dtype=self.dtype, casting="safe")


def _as_rows(chunk: Any, what: str) -> np.ndarray:
    chunk = as_host_array(chunk, what)
    check_integer_dtype(chunk, what)
    if is_canonical(chunk.dtype):
        return np.ascontiguousarray(chunk)
    # Any rank: compaction only looks at values, so a [values, 1, 1] view serves.
    return compact_routes(chunk.reshape(-1, 1, 1), name=what, health=None).reshape(chunk.shape)
