"""`collate_selections`: every layout, with positions shifted by left padding and packing offsets,
against the position-by-position reference; rank and stage shares equal to the global batch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.reference_selections import random_capture, reference_collate
from torch_r3 import Memory, Packed, Padded
from torch_r3.collate.selections import SELECTION_MASK, SELECTIONS, collate_selections
from torch_r3.indexer import IndexerSelections

KEYS = (SELECTIONS, SELECTION_MASK)


def _batch(seed=0, counts=(30, 12, 1, 25), topk=8, layers=3, uncaptured=(1, 3, 0, 6)):
    rng = np.random.default_rng(seed)
    dense = [random_capture(rng, n - u, layers, topk, share=(2,)) for n, u in zip(counts, uncaptured)]
    return dense, [IndexerSelections.from_dense(d) for d in dense], list(counts)


def _same(got, want, keys):
    for key in keys:
        np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("workers", [1, 3])
def test_padded_batch_shifts_each_sample_by_its_padding(padding_side, workers):
    dense, sels, counts = _batch()
    got = collate_selections(
        sels,
        counts,
        layout=Padded(side=padding_side),
        memory=Memory(workers=workers),
    )
    want = reference_collate(dense, counts, padding_side=padding_side)
    _same(got, want, KEYS + ("attention_mask",))
    assert got[SELECTIONS].dtype == torch.int16


@pytest.mark.parametrize("workers", [1, 3])
def test_packed_batch_shifts_each_sample_by_its_offset(workers):
    dense, sels, counts = _batch(1)
    got = collate_selections(sels, counts, layout="packed", memory=Memory(workers=workers))
    want = reference_collate(dense, counts, layout="packed")
    _same(got, want, KEYS + ("cu_seqlens",))


def test_a_rank_with_the_global_seq_len_gets_the_global_rows():
    dense, sels, counts = _batch(2)
    full = collate_selections(sels, counts)
    T = full[SELECTIONS].shape[1]
    mine = [1, 3]
    part = collate_selections([sels[i] for i in mine], [counts[i] for i in mine], layout=Padded(seq_len=T))
    for key in KEYS:
        assert torch.equal(part[key], full[key][mine])
    # Without the global length the positions would differ: the shift depends on T.
    alone = collate_selections([sels[i] for i in mine], [counts[i] for i in mine])
    assert alone[SELECTIONS].shape[1] < T


def test_stage_layers_are_the_global_batch_s_layers():
    dense, sels, counts = _batch(3)
    full = collate_selections(sels, counts)
    for keep in ([0], [1, 2], [2, 0]):
        part = collate_selections(sels, counts, keep_layers=keep)
        assert torch.equal(part[SELECTIONS], full[SELECTIONS][:, :, keep])
        want = reference_collate(dense, counts, keep_layers=keep)
        _same(part, want, KEYS)


def test_pad_to_multiple_of_and_seq_len_pad_on_the_left():
    dense, sels, counts = _batch(4)
    got = collate_selections(sels, counts, layout=Padded(pad_to_multiple_of=16))
    _same(got, reference_collate(dense, counts, seq_len=32), KEYS)
    got = collate_selections(sels, counts, layout=Padded(seq_len=40))
    _same(got, reference_collate(dense, counts, seq_len=40), KEYS)


def test_context_parallel_split_keeps_global_key_positions():
    """A CP rank keeps its chunks' query rows (Megatron's 2*cp zigzag); positions are not shifted."""
    slicing = pytest.importorskip("torch_r3.megatron.slicing")
    dense, sels, counts = _batch(5, counts=(16, 12), uncaptured=(1, 0))
    full = collate_selections(sels, counts)
    want = reference_collate(dense, counts)
    T = full[SELECTIONS].shape[1]
    seen = []
    for rank in range(2):
        pos = slicing.context_parallel_positions(T, 2, rank)
        local = full[SELECTIONS][:, pos]
        np.testing.assert_array_equal(local.numpy(), want[SELECTIONS][:, pos.numpy()])
        seen.append(pos)
        # A rank's late chunk selects keys in the other rank's chunks: positions name the whole sequence.
        assert int(local.max()) >= T // 2
    assert sorted(torch.cat(seen).tolist()) == list(range(T))
    cu = full[SELECTIONS].new_tensor([0, 16, 28], dtype=torch.int32)
    packed = collate_selections(sels, counts, layout="packed")
    pw = reference_collate(dense, counts, layout="packed")
    pos = slicing.packed_positions(cu, 2, 1)
    np.testing.assert_array_equal(packed[SELECTIONS][pos].numpy(), pw[SELECTIONS][pos.numpy()])


def test_int32_when_a_position_does_not_fit_int16():
    sel = IndexerSelections.from_dense(random_capture(np.random.default_rng(0), 3, 1, 2))
    assert collate_selections([sel], [3], layout=Padded(seq_len=1 << 15))[SELECTIONS].dtype == torch.int16
    assert collate_selections([sel], [3], layout=Padded(seq_len=(1 << 15) + 1))[SELECTIONS].dtype == torch.int32
    with pytest.raises(ValueError, match="cannot hold position 32768"):
        collate_selections([sel], [3], layout=Padded(seq_len=(1 << 15) + 1), dtype=torch.int16)
    assert collate_selections([sel], [3], dtype="int32")[SELECTIONS].dtype == torch.int32


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_batch_over_the_output_bound_is_refused_naming_its_size(monkeypatch, layout):
    # As collate_routes: TORCH_R3_MAX_OUTPUT_BYTES (else the physical memory) bounds the output bytes.
    monkeypatch.setenv("TORCH_R3_MAX_OUTPUT_BYTES", str(1 << 20))
    sel = IndexerSelections.from_dense(random_capture(np.random.default_rng(0), 3, 4, 512))
    counts = [4096] * 4  # 3 captured rows each, the rest uncaptured: 64 MiB of int16 selections
    rows = 4 * 4096
    total = rows * 4 * 512 * 2 + rows + (rows * 8 if layout == "padded" else 5 * 4)
    with pytest.raises(ValueError, match=rf"would allocate {total} bytes .* more than the bound of 1048576 bytes"):
        collate_selections([sel] * 4, counts, layout=layout)
    monkeypatch.setenv("TORCH_R3_MAX_OUTPUT_BYTES", str(total))
    assert collate_selections([sel] * 4, counts, layout=layout)[SELECTIONS].nbytes == rows * 4 * 512 * 2


def test_a_batch_no_memory_holds_is_refused_before_anything_is_allocated():
    # 2**31 - 1 positions of 8 layers x 4096 int32: 256 TiB, past the physical memory of any host
    # (and past its address space: an allocation attempt would fail as a MemoryError instead)
    sel = IndexerSelections.from_dense(random_capture(np.random.default_rng(0), 1, 8, 4096))
    with pytest.raises(
        ValueError, match=r"would allocate \d+ bytes \(\d+\.\d GiB: rollout_indexer_topk \[1, 2147483647, 8, 4096\]"
    ):
        collate_selections([sel], [2**31 - 1])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda s: collate_selections([s, "x"], [5, 5]), TypeError, "sample 1: expected IndexerSelections"),
        (lambda s: collate_selections([s], [4]), ValueError, "sample 0: 5 selection rows for 4 tokens"),
        (lambda s: collate_selections([s], [5, 6]), ValueError, "2 entries for 1 samples"),
        (
            lambda s: collate_selections([s], [5], layout=Padded(seq_len=4)),
            ValueError,
            "sample 0 has 5 tokens, more than seq_len=4",
        ),
        (lambda s: collate_selections([s], [5], keep_layers=[2]), ValueError, r"layer 2 is not in \[0, 2\)"),
        (
            lambda s: collate_selections([s], [5], layout=Packed(pad_to_multiple_of=2)),
            ValueError,
            "a packed batch with pad_to_multiple_of is not supported",
        ),
        (lambda s: collate_selections([s], [5], dtype="int8"), ValueError, "dtype must be int16 or int32"),
        (lambda s: collate_selections([], []), ValueError, "empty"),
    ],
)
def test_misuse_is_refused_naming_the_sample_or_argument(call, error, message):
    sel = IndexerSelections.from_dense(random_capture(np.random.default_rng(0), 5, 2, 2))
    with pytest.raises(error, match=message):
        call(sel)


def test_samples_of_other_layers_or_topk_are_refused():
    rng = np.random.default_rng(0)
    a = IndexerSelections.from_dense(random_capture(rng, 5, 2, 2))
    b = IndexerSelections.from_dense(random_capture(rng, 5, 2, 3))
    with pytest.raises(ValueError, match=r"sample 1: selections of \[layers=2, index_topk=3\]"):
        collate_selections([a, b], [5, 5])


def test_the_thread_pool_writes_the_same_batch_as_one_thread():
    """Above the serial threshold (4 MiB) the tasks run on several threads; the bytes must not change."""
    rng = np.random.default_rng(9)
    counts = [700, 300, 650, 20]
    dense = [random_capture(rng, n - 1, 3, 64, share=(2,), style="local") for n in counts]
    sels = [IndexerSelections.from_dense(d) for d in dense]
    one = collate_selections(
        sels,
        counts,
        layout=Padded(seq_len=4096),
        memory=Memory(workers=1),
    )
    assert one[SELECTIONS].numel() * 2 > 4 << 20
    many = collate_selections(
        sels,
        counts,
        layout=Padded(seq_len=4096),
        memory=Memory(workers=4),
    )
    for key in (SELECTIONS, SELECTION_MASK, "attention_mask"):
        assert torch.equal(one[key], many[key]), key
    # And one thread's batch is the reference's, on the rows of the longest sample.
    want = reference_collate([dense[0]], [counts[0]], seq_len=4096)
    np.testing.assert_array_equal(one[SELECTIONS][:1].numpy(), want[SELECTIONS])
