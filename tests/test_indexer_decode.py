"""The vectorised decoder behind `IndexerSelections.write_layer` and `collate_selections`: any capture,
any row range, any block size, any output dtype and shift, bit-identical to the loop reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import torch_r3.collate._pool as pool_mod
import torch_r3.collate.selections as collate_mod
import torch_r3.selections as encoding_mod
from tests.reference_selections import FILL, random_capture, reference_collate, sorted_rows
from torch_r3 import Memory
from torch_r3.indexer import IndexerSelections, collate_selections


def _expected(dense, layer, lo, hi, offset):
    want = sorted_rows(dense)[lo:hi, layer]
    return np.where(want == FILL, FILL, want + offset)


@settings(max_examples=60, deadline=None)
@given(
    # Up to 1400 rows at top-k 2..6: early rows are bitmaps, late ones gap rows, many with escaped gaps.
    rows=st.integers(0, 1400),
    topk=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    style=st.sampled_from(["uniform", "local"]),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    offset=st.integers(0, 2000),
    dtype=st.sampled_from([np.int16, np.int32, np.int64]),
    block_bits=st.sampled_from([1, 64, 4096, 1 << 20]),
    block_gaps=st.sampled_from([1, 16, 1 << 18]),
)
def test_any_row_range_decodes_to_the_reference(rows, topk, seed, style, cut, offset, dtype, block_bits, block_gaps):
    dense = random_capture(np.random.default_rng(seed), rows, 2, topk, style=style)
    sel = IndexerSelections.from_dense(dense)
    lo, hi = sorted(int(c * rows) for c in cut)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(encoding_mod, "_BLOCK_BITS", block_bits)
        mp.setattr(encoding_mod, "_BLOCK_GAPS", block_gaps)
        for layer in range(2):
            out = np.full((hi - lo, topk), 12345, dtype=dtype)
            sel.write_layer(layer, out, offset=offset, rows=(lo, hi))
            np.testing.assert_array_equal(out, _expected(dense, layer, lo, hi, offset))
            whole = np.full((rows, topk), 12345, dtype=dtype)
            sel.write_layer(layer, whole, offset=offset)
            np.testing.assert_array_equal(whole, _expected(dense, layer, 0, rows, offset))


def test_the_captures_exercise_every_stream():
    """The property test's captures hold bitmap rows, gap rows and escaped gaps (else it would prove little)."""
    dense = random_capture(np.random.default_rng(0), 1400, 1, 4)
    sel = IndexerSelections.from_dense(dense)
    code = sel._codes[0]
    assert code.is_bitmap.any() and not code.is_bitmap.all()
    assert code.exceptions.size > 0


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    piece=st.integers(1, 50),
    layout=st.sampled_from(["padded", "packed"]),
    workers=st.sampled_from([1, 3]),
)
def test_collation_in_pieces_of_rows_is_the_reference(seed, piece, layout, workers):
    rng = np.random.default_rng(seed)
    counts = [int(n) for n in rng.integers(1, 160, 3)]
    dense = [random_capture(rng, n - int(rng.integers(0, 3)) if n > 2 else n, 3, 4, share=(2,)) for n in counts]
    sels = [IndexerSelections.from_dense(d) for d in dense]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(collate_mod, "_PIECE_ROWS", piece)
        mp.setattr(pool_mod, "SERIAL_BELOW_BYTES", 0)
        got = collate_selections(sels, counts, layout=layout, memory=Memory(workers=workers))
    want = reference_collate(dense, counts, layout=layout)
    for key in ("rollout_indexer_topk", "indexer_padding_mask"):
        np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)


def test_a_row_range_outside_the_rows_is_refused():
    sel = IndexerSelections.from_dense(random_capture(np.random.default_rng(0), 10, 1, 2))
    with pytest.raises(ValueError, match=r"rows: expected 0 <= lo <= hi <= 10, got \(4, 11\)"):
        sel.write_layer(0, np.empty((7, 2), np.int32), rows=(4, 11))
    with pytest.raises(ValueError, match=r"out: expected shape \[3, 2\]"):
        sel.write_layer(0, np.empty((4, 2), np.int32), rows=(4, 7))
