"""`check_selection_values`: the first bad captured row, named as a plain loop over the rows names it,
however the rows are cut into pieces; and the check's own memory bounded by one piece, not the batch.

Memory is counted, not timed: a dispatch mode sees every tensor torch's operators create while
the check runs and keeps the bytes of those still alive (each storage once, until its last
tensor is gone); the peak of that sum is exact and the same on every run.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.reference_selections import FILL, random_capture
from torch_r3.collate.selections import SELECTION_MASK, SELECTIONS, collate_selections
from torch_r3.indexer import IndexerSelections
from torch_r3.replay import selection_checks as checks
from torch_r3.replay.selection_checks import check_selection_values


class TorchBytes(TorchDispatchMode):
    """The peak bytes of the tensors torch's operators create while active, beyond `existing`."""

    def __init__(self, existing):
        super().__init__()
        self.external = {t.untyped_storage().data_ptr() for t in existing}
        self.refs: dict[int, list[int]] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def track(self, t):
        key = t.untyped_storage().data_ptr()
        if key == 0 or key in self.external:
            return
        if key in self.refs:
            self.refs[key][0] += 1
        else:
            self.refs[key] = [1, t.untyped_storage().nbytes()]
            self.live += self.refs[key][1]
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self.release, key)

    def release(self, key):
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


def clean_batch(B, T, L, K, dtype=torch.int16, uncaptured=3):
    """`[B, T, L, K]` valid selections: every row selects its first `K` visible positions, sample `b` left-padded by `b`."""
    t = torch.arange(T).view(1, T, 1, 1)
    first = torch.arange(B).view(B, 1, 1, 1) * uncaptured
    k = torch.arange(K).view(1, 1, 1, K)
    sel = torch.where(first + k <= t, first + k, FILL).expand(B, T, L, K).to(dtype).contiguous()
    mask = torch.arange(T).view(1, T) < first.view(B, 1)
    return sel, mask


def peak_bytes(sel, mask):
    with TorchBytes([sel, mask]) as meter:
        check_selection_values(sel, mask, list(range(sel.shape[2])))
    return meter.peak


def test_the_meter_counts_what_an_operator_allocates_and_what_it_frees():
    x = torch.zeros(1 << 20, dtype=torch.int16)
    with TorchBytes([x]) as meter:
        y = x.to(torch.int64)  # 8 MiB
        z = y[1:] * 2  # a view (nothing new), then 8 MiB more
        del y
        w = z + 1  # y's storage lives on in nobody: freed before w is made
        del z, w
    assert (meter.peak, meter.live) == (2 * 8 * (1 << 20) - 8, 0)


SLOTS = 1 << 16  # pieces of 64 Ki slots (the default is 1 Mi): small batches show the bound quickly


@pytest.mark.parametrize("samples", [2, 4])
def test_checking_a_clean_batch_takes_one_piece_of_memory_whatever_the_batch(monkeypatch, samples):
    monkeypatch.setattr(checks, "CHECK_SLOTS", SLOTS, raising=False)
    sel, mask = clean_batch(samples, 512, 2, 512)
    assert sel.nbytes == samples * 2**20  # 2 and 4 MiB
    peak = peak_bytes(sel, mask)
    # one piece's temporaries, about 40 bytes a slot (2.5 MiB), the same for every batch;
    # checking the whole batch at once took about 16 bytes per byte of an int16 batch
    assert peak <= 40 * SLOTS, f"{peak / 2**20:.1f} MiB for a {sel.nbytes >> 20} MiB batch"


def test_a_large_batch_is_checked_in_a_bounded_number_of_pieces_each_a_small_share_of_it(monkeypatch):
    monkeypatch.setattr(checks, "CHECK_SLOTS", 1024, raising=False)  # far below a 64th of the batch
    sel, mask = clean_batch(4, 512, 2, 512)  # 2 Mi slots, 4 MiB: 64 pieces of 32 Ki slots
    peak = peak_bytes(sel, mask)
    assert 20 * 2**15 <= peak <= 40 * 2**15, f"{peak / 2**20:.2f} MiB"  # about 34 bytes a slot of one piece


def test_the_error_path_is_bounded_by_one_piece_too(monkeypatch):
    monkeypatch.setattr(checks, "CHECK_SLOTS", SLOTS, raising=False)
    sel, mask = clean_batch(4, 512, 2, 512)
    sel[3, 500, 1, 5] = 1  # sample 3 starts at 9
    with TorchBytes([sel, mask]) as meter, pytest.raises(ValueError, match="batch row 3, position 500"):
        check_selection_values(sel, mask, [0, 1])
    assert meter.peak <= 2 * 40 * SLOTS


def reference_fault(sel, mask, layers):
    """The message for the first bad captured row in row-major (batch row, position, column) order, or None."""
    B, T, L, K = sel.shape
    for b in range(B):
        captured = [t for t in range(T) if not mask[b, t]]
        first = captured[0] if captured else T
        for pos in captured:
            for col in range(L):
                row = [int(x) for x in sel[b, pos, col]]
                chosen = [p for p in row if p != FILL]
                where = f"layer {layers[col]}, batch row {b}, position {pos}"
                outside = [p for p in row if p < FILL or (p != FILL and not first <= p <= pos)]
                if outside:
                    return f"{where}: selects position {outside[0]}, outside [{first}, {pos}]"
                if len(set(chosen)) != len(chosen):
                    return f"{where}: selects a position twice"
                want = min(K, pos - first + 1)
                if len(chosen) != want:
                    return f"{where}: selects {len(chosen)} positions, expected {want}"
    return None


def collated(seed, counts, uncaptured, layers=2, topk=4):
    rng = np.random.default_rng(seed)
    dense = [random_capture(rng, n - u, layers, topk) for n, u in zip(counts, uncaptured)]
    batch = collate_selections([IndexerSelections.from_dense(d) for d in dense], counts)
    return batch[SELECTIONS], batch[SELECTION_MASK]


@pytest.mark.parametrize("slots", [8, 24, 96, 1 << 20])  # a row a piece .. several samples a piece
@pytest.mark.parametrize("seed", range(6))
def test_the_first_bad_row_is_the_one_a_plain_loop_finds_however_the_rows_are_cut(monkeypatch, slots, seed):
    monkeypatch.setattr(checks, "CHECK_SLOTS", slots, raising=False)
    sel, mask = collated(seed, (13, 9, 1, 11), (1, 3, 0, 2))
    check_selection_values(sel, mask, [3, 7])  # clean
    rng = np.random.default_rng(100 + seed)
    B, T, L, K = sel.shape
    for _ in range(int(rng.integers(1, 4))):  # one to three faults anywhere, padding included
        b, t, c, k = (int(rng.integers(n)) for n in (B, T, L, K))
        sel[b, t, c, k] = int(rng.choice([FILL, -3, 0, t, t + 1, T - 1, int(sel[b, t, c, (k + 1) % K])]))
    want = reference_fault(sel, mask, [3, 7])
    if want is None:
        check_selection_values(sel, mask, [3, 7])
    else:
        with pytest.raises(ValueError) as info:
            check_selection_values(sel, mask, [3, 7], prefix="microbatch 2, ")
        assert str(info.value).startswith(f"microbatch 2, {want}")
