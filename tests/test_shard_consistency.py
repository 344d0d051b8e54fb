"""`ShardCollator` keeps its promise, bit-identical to the global batch, in the corners users reach.

Each test holds a mistake that used to pass silently: a per-token key whose Python lists mix
ints and floats (a micro-batch of int samples came out int64, the global batch float64), a
shared pool given with a `cache_bytes` it dropped, and a prefetching iterator alive at
interpreter exit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.samples import route_samples
from torch_r3 import BufferPool, Memory, R3Collator, ShardCollator

ROOT = Path(__file__).resolve().parents[1]


def _store(advantages: list[list]) -> list[dict]:
    samples = route_samples(0, [len(a) for a in advantages], captured="all_but_last", num_layers=2, topk=2)
    return [{**sample, "adv": a} for sample, a in zip(samples, advantages)]


MIXED = _store([[0, 0, 0], [0.5, -1.0], [1, 2, 3, 4], [0.25, 0.0, 1.5]])  # int lists and float lists


def test_a_pad_key_mixing_int_and_float_lists_is_refused_in_the_global_batch():
    with pytest.raises(ValueError) as e:
        R3Collator(pad_keys={"adv": 0}, pad_token_id=0)(MIXED)
    assert str(e.value).startswith("sample 1: 'adv' is a list of float64 values and sample 0's a list of int64")
    assert "[float(v) for v in values]" in str(e.value)
    one_token = _store([[1, 2]]) + [{"input_ids": [7], "routes": np.zeros((0, 2, 2), np.uint8), "adv": [0.5]}]
    with pytest.raises(ValueError, match="list of float64 values"):
        R3Collator(pad_keys={"adv": 0}, pad_token_id=0)(one_token)


def test_a_shard_whose_microbatches_would_differ_in_dtype_is_refused():
    # Micro-batch 0 holds only int lists, micro-batch 1 only float lists: each is consistent alone.
    shard = ShardCollator(lambda idx: [MIXED[i] for i in idx], [[0, 2], [1, 3]], pad_keys={"adv": 0}, pad_token_id=0)
    it = iter(shard)
    assert next(it)["adv"].dtype == torch.int64
    with pytest.raises(ValueError, match=r"micro-batch 1 \(\[1, 3\]\): 'adv' came out torch.float64, the first"):
        next(it)


def test_one_kind_of_list_and_arrays_of_mixed_dtypes_still_collate_as_before():
    floats = _store([[0.0, 0.0, 0.0], [0.5, -1.0]])
    assert R3Collator(pad_keys={"adv": 0}, pad_token_id=0)(floats)["adv"].dtype == torch.float64
    arrays = [dict(s, adv=np.asarray(s["adv"], dt)) for s, dt in zip(floats, (np.float32, np.float16))]
    assert (
        R3Collator(pad_keys={"adv": 0}, pad_token_id=0)(arrays)["adv"].dtype == torch.float32
    )  # promoted by torch's rules


def test_a_shared_pool_with_cache_bytes_is_refused_not_dropped():
    with pytest.raises(ValueError, match=r"^pass buffers= or cache_bytes=, not both"):
        ShardCollator(
            lambda idx: [],
            [[0]],
            memory=Memory(cache_bytes=0, buffers=BufferPool()),
            pad_token_id=0,
        )
    pool = BufferPool(cache_bytes=0)
    assert ShardCollator(lambda idx: [], [[0]], memory=Memory(buffers=pool), pad_token_id=0).collator.buffers is pool


_ALIVE_AT_EXIT = """
import numpy as np
from torch_r3 import ShardCollator
store = [{"input_ids": list(range(n)), "routes": np.zeros((n - 1, 2, 2), np.uint8)} for n in (3, 4, 5, 6)]
shard = ShardCollator(lambda idx: [store[i] for i in idx], [[0], [1], [2, 3]], prefetch=True, pad_token_id=0)
it = iter(shard)
batch = next(it)  # the iterator, its helper thread and the next fetch are alive when the interpreter exits
print(batch["input_ids"].tolist())
"""


def test_a_prefetching_shard_alive_at_interpreter_exit_exits_quietly():
    done = subprocess.run(
        [sys.executable, "-c", _ALIVE_AT_EXIT], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert done.returncode == 0 and done.stdout == "[[0, 1, 2]]\n"
    assert done.stderr == ""
