"""The dtype of a batch's other keys (issue 43.1): the widest of the samples' values, as NumPy promotes.

`reward = 0 if failed else score` with an int first came out float32 (0.1 became 0.10000000149,
1e40 inf); per-sample float32 and float64 arrays stacked to float64 in the main process but to
float32 in a DataLoader worker; and a micro-batch came out another dtype than the global batch.
The reference here is NumPy's own promotion of the same values, `np.stack([np.asarray(v) ...])`,
computed independently of the collator, in the main process, in real DataLoader workers and per
micro-batch of a `ShardCollator`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from torch_r3 import R3Collator, ShardCollator

B = 4

# Each sample's value of the extra key "x", for B samples.
CASES = {
    "int-first-then-floats": [0, 0.1, 1e40, 16777217.0],
    "float-first-then-ints": [0.1, 0, 3, 2.5],
    "ints": [1, -2, 2**62, 7],
    "bools-and-ints": [True, False, 3, 0],
    "bools": [True, False, True, True],
    "numpy-float32-and-python-float": [np.float32(0.5), 0.1, np.float32(2.0), 1e-300],
    "numpy-int16-and-float16": [np.int16(300), np.float16(0.5), np.int16(-7), np.float16(1.5)],
    "float32-and-float64-arrays": [
        np.float32([0.5, 1.5]),
        np.float64([0.1, 1e40]),
        np.float32([2.0, 3.0]),
        np.float64([1e-300, 5.0]),
    ],
    "int32-and-float32-arrays": [np.int32([16777217, 1]), np.float32([0.5, 2]), np.int32([3, 4]), np.float32([1, 1])],
    "int-and-float-lists": [[1, 2], [0.1, 2.5], [3, 4], [16777217, 0]],
    "float32-and-float64-tensors": [
        torch.tensor([0.5], dtype=torch.float32),
        torch.tensor([0.1], dtype=torch.float64),
        torch.tensor([2.0], dtype=torch.float32),
        torch.tensor([1e40], dtype=torch.float64),
    ],
}


def reference(values):
    """NumPy's promotion of the values, stacked: the batch's expected tensor."""
    arrays = [v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in values]
    return torch.from_numpy(np.stack(arrays))


def samples_with(values):
    rng = np.random.default_rng(len(values))
    out = []
    for i, v in enumerate(values):
        n = int(rng.integers(2, 6))
        out.append(
            {
                "input_ids": rng.integers(1, 100, n).tolist(),
                "routes": rng.integers(0, 8, (n - 1, 2, 2)).astype(np.uint8),
                "x": v,
                "index": i,
            }
        )
    return out


def assert_exact(got, want, where):
    assert got.dtype == want.dtype, (where, got.dtype, want.dtype)
    assert torch.equal(got, want), (where, got, want)


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_an_extra_key_collates_to_numpy_s_promotion_of_its_values(values):
    want = reference(values)
    batch = R3Collator(pad_token_id=0)(samples_with(values))
    assert_exact(batch["x"], want, "main process")
    assert_exact(batch["index"], torch.arange(B), "index")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_collate_extra_keys_as_the_main_process_does(context):
    # A worker stacks into shared memory of the first value's dtype unless every value already has the batch's.
    names = ["int-first-then-floats", "float32-and-float64-arrays", "float32-and-float64-tensors", "bools-and-ints"]
    dataset = []
    for name in names:
        dataset.extend(samples_with(CASES[name]))
    loader = DataLoader(
        dataset,
        batch_size=B,
        collate_fn=R3Collator(pad_token_id=0),
        num_workers=2,
        multiprocessing_context=context,
    )
    batches = list(loader)
    assert len(batches) == len(names)
    for name, batch in zip(names, batches):
        assert batch["x"].is_shared()  # built in a worker
        assert_exact(batch["x"], reference(CASES[name]), f"{context} worker, {name}")


def test_a_microbatch_s_extra_keys_equal_the_global_batch_s_rows():
    values = [0, 0.1, 2, 1e40, 16777217.0, 3, -1.5, 4]  # the global batch mixes ints and floats
    samples = samples_with(values)
    want = reference(values)
    plan = [[1, 6], [0, 3], [4, 2], [5, 7]]  # micro-batch [5, 7] holds ints only
    shard = ShardCollator(lambda idx: [samples[i] for i in idx], plan, pad_token_id=0, extra_dtypes={"x": want.dtype})
    for mb, batch in zip(plan, shard):
        assert_exact(batch["x"], want[mb], f"micro-batch {mb}")
    # Without the global dtype, the micro-batch of ints alone cannot know the others' floats: refused, not mixed.
    shard = ShardCollator(lambda idx: [samples[i] for i in idx], plan, pad_token_id=0)
    with pytest.raises(
        ValueError, match=r"micro-batch 3 \(\[5, 7\]\): extra key 'x' came out torch.int64.*extra_dtypes"
    ):
        for mb, batch in zip(plan, shard):
            assert_exact(batch["x"], want[mb], f"micro-batch {mb}")


def test_a_global_dtype_that_cannot_hold_a_value_exactly_is_refused_naming_it():
    samples = samples_with([0, 0.1, 2, 3])
    with pytest.raises(ValueError, match=r"sample 1: extra key 'x' is float64.*extra_dtypes\['x'\] = int64"):
        R3Collator(pad_token_id=0, extra_dtypes={"x": torch.int64})(samples)
    with pytest.raises(ValueError, match=r"extra_dtypes names 'y', which the samples do not hold"):
        R3Collator(pad_token_id=0, extra_dtypes={"y": torch.float64})(samples)
    with pytest.raises(ValueError, match=r"extra_dtypes may not name the routes/tokens/pad keys"):
        R3Collator(pad_token_id=0, extra_dtypes={"input_ids": torch.int64})
    with pytest.raises(TypeError, match=r"extra_dtypes\['x'\]"):
        R3Collator(pad_token_id=0, extra_dtypes={"x": "not a dtype"})


@pytest.mark.parametrize(
    "values, match",
    [
        ([2**60 + 1, 0.5, 1, 2], r"sample 0: extra key 'x' holds an int beyond 2\*\*53"),
        ([2**63, -1, 1, 2], r"sample 0: extra key 'x' holds an int beyond 2\*\*53"),
        ([np.int64([2**55 + 1]), np.float32([0.5]), np.int64([1]), np.int64([2])], r"sample 0: .*beyond 2\*\*53"),
        ([2**64, 1, 2, 3], r"sample 0: extra key 'x' holds 18446744073709551616, which fits no 64-bit"),
        ([[1, 2], [3, 4], [2**60 + 1, 0.5], [5, 6]], r"sample 2: extra key 'x' mixes ints beyond 2\*\*53 with floats"),
    ],
    ids=["int64-and-float", "uint64-and-int64", "int64-array-and-float32", "beyond-uint64", "within-one-list"],
)
def test_values_no_dtype_holds_exactly_are_refused_naming_the_sample(values, match):
    with pytest.raises(ValueError, match=match):
        R3Collator(pad_token_id=0)(samples_with(values))
