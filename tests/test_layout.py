"""The geometry arguments of the kernel (`seq_len=`, `dtype=`, `keep_layers=`, `sample_ids=`) and `global_geometry`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.reference_collate import assert_batch_equal, reference_collate_routes
from tests.samples import route_samples, router_routes
from tests.spelling import torch_r3_options
from torch_r3 import Padded, R3Collator, collate_routes, global_geometry

GOOD = np.zeros((2, 4, 2), np.uint8)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_property_geometry_arguments_match_the_reference(data):
    B = data.draw(st.integers(1, 5))
    L = data.draw(st.integers(1, 5))
    K = data.draw(st.integers(1, 3))
    layout = data.draw(st.sampled_from(["padded", "packed"]))
    padding = data.draw(st.sampled_from(["arange", "balanced"]))
    experts = data.draw(st.integers(K, 300)) if padding == "balanced" else None
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    counts = [int(rng.integers(1, 12)) for _ in range(B)]
    dtypes = [data.draw(st.sampled_from([np.uint8, np.int16])) for _ in range(B)]
    # ids below num_experts where the filler takes it (the collator checks them against it)
    below = min(experts, 200) if experts else 200
    samples = route_samples(rng, counts, num_layers=L, topk=K, num_experts=below, dtypes=dtypes, token_ids=None)
    routes = [sample["routes"] for sample in samples]
    layers = data.draw(st.none() | st.permutations(range(L)).flatmap(lambda p: st.just(p[: max(1, len(p) // 2)])))
    ids = data.draw(st.none() | st.lists(st.integers(0, 2**40), min_size=B, max_size=B, unique=True))
    dtype = data.draw(st.sampled_from([None, np.int16, np.int32, torch.int32]))
    seq_len = None
    if layout == "padded" and data.draw(st.booleans()):
        seq_len = max(counts) + data.draw(st.integers(0, 5))
    kw = {"layout": layout, "filler": padding, "num_experts": experts}
    got = collate_routes(
        routes, counts, dtype=dtype, keep_layers=layers, sample_ids=ids, **torch_r3_options(seq_len=seq_len, **kw)
    )
    np_dtype = {None: None, np.int16: np.int16, np.int32: np.int32, torch.int32: np.int32}[dtype]
    want = reference_collate_routes(
        routes, counts, seq_len=seq_len, dtype=np_dtype, keep_layers=layers, sample_ids=ids, **kw
    )
    assert_batch_equal(got, want)


@pytest.mark.parametrize("layers", [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3], [3, 1], [2, 0, 3], [2], range(1, 3)])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_layers_hold_exactly_the_chosen_layers_in_order(layers, layout):
    rng = np.random.default_rng(3)
    routes = [router_routes(rng, r, 4, 3, num_experts=9) for r in (3, 0, 7)]
    counts = [4, 2, 7]
    got = collate_routes(routes, counts, layout=layout, keep_layers=layers, filler="balanced", num_experts=9)
    want = reference_collate_routes(
        routes, counts, layout=layout, keep_layers=list(layers), filler="balanced", num_experts=9
    )
    assert_batch_equal(got, want)


def test_seq_len_pads_input_ids_and_pad_keys_to_the_same_length():
    samples = [
        {"input_ids": [1, 2, 3], "routes": np.zeros((2, 4, 2), np.uint8), "m": [1.0, 1.0, 1.0]},
        {"input_ids": [4], "routes": np.zeros((1, 4, 2), np.uint8), "m": [2.0]},
    ]
    got = R3Collator(
        layout=Padded(pad_to_multiple_of=3, seq_len=6),
        pad_keys={"m": -1.0},
        pad_token_id=0,
    )(samples)
    assert got["input_ids"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 0, 0, 0, 0, 4]]
    assert got["m"].tolist() == [[-1.0] * 3 + [1.0] * 3, [-1.0] * 5 + [2.0]]
    assert got["rollout_expert_indices"].shape == (2, 6, 4, 2)


@pytest.mark.parametrize(
    "kwargs, counts, exc, match",
    [
        ({"seq_len": 3}, [2, 4], ValueError, "sample 1 has 4 tokens, more than seq_len=3"),
        ({"seq_len": 0}, [2], ValueError, "seq_len must be >= 1"),
        ({"seq_len": 4.0}, [2], TypeError, "seq_len must be an int"),
        (
            {"seq_len": 6, "pad_to_multiple_of": 4},
            [2],
            ValueError,
            "seq_len=6 is not a multiple of pad_to_multiple_of=4",
        ),
        ({"seq_len": 4, "layout": "packed"}, [2], TypeError, "unexpected keyword argument 'seq_len'"),
        (
            {"dtype": np.uint8},
            [2, 2],
            ValueError,
            r"routes\[1\]: dtype int16 is wider than dtype=uint8.*never narrowed",
        ),
        ({"dtype": np.int64}, [2], ValueError, "dtype must be uint8, int16 or int32"),
        ({"dtype": torch.float32}, [2], ValueError, "dtype must be uint8, int16 or int32, got torch.float32"),
        ({"dtype": "bogus"}, [2], TypeError, "dtype must be a NumPy or torch dtype"),
        (
            {"dtype": np.uint8, "filler": "balanced", "num_experts": 300},
            [2],
            ValueError,
            r"dtype=uint8 cannot hold the balanced filler's expert id 299; use dtype=int16",
        ),
        ({"keep_layers": [4]}, [2], ValueError, r"keep_layers\[0\]: layer 4 is out of range for routes with 4 layers"),
        ({"keep_layers": [1, 1]}, [2], ValueError, r"keep_layers\[1\]: layer index 1 is listed twice"),
        ({"keep_layers": [-1]}, [2], ValueError, r"keep_layers\[0\]: layer index -1 is negative"),
        ({"keep_layers": [True]}, [2], TypeError, r"keep_layers\[0\] must be an int"),
        ({"keep_layers": []}, [2], ValueError, "keep_layers must hold at least one layer index"),
        ({"keep_layers": 2}, [2], TypeError, "keep_layers must be a sequence"),
        ({"sample_ids": [0]}, [2, 2], ValueError, "sample_ids: expected 2 ids"),
        ({"sample_ids": [3, 3]}, [2, 2], ValueError, r"sample_ids\[1\]: id 3 is listed twice"),
        ({"sample_ids": [0, -1]}, [2, 2], ValueError, r"sample_ids\[1\]: id -1 is outside \[0, "),
        ({"sample_ids": [0, 1.0]}, [2, 2], TypeError, r"sample_ids\[1\] must be an int"),
        ({"max_output_bytes": 0}, [2], ValueError, "max_output_bytes must be >= 1"),
        ({"compact": "yes"}, [2], TypeError, "compact must be True or False"),
    ],
)
def test_bad_geometry_arguments_are_refused_naming_them(kwargs, counts, exc, match):
    routes = [GOOD, GOOD.astype(np.int16)][: len(counts)]
    with pytest.raises(exc, match=match):  # the layout and memory values are built inside, as a caller builds them
        collate_routes(routes, counts, **torch_r3_options(**kwargs))


def test_global_geometry_is_what_collate_routes_chooses():
    rng = np.random.default_rng(9)
    counts = [int(n) for n in rng.integers(1, 30, size=9)]
    for dtypes, padding, experts, multiple in [
        ([np.uint8] * 9, "arange", None, None),
        ([np.uint8] * 8 + [np.int32], "arange", None, 8),
        ([np.uint8] * 9, "balanced", 300, 16),
        ([np.int16] * 9, "balanced", 64, None),
    ]:
        routes = [np.zeros((n - 1, 2, 2), d) for n, d in zip(counts, dtypes)]
        batch = collate_routes(
            routes, counts, filler=padding, num_experts=experts, layout=Padded(pad_to_multiple_of=multiple)
        )
        layout = global_geometry(
            counts,
            {np.dtype(d) for d in dtypes},
            filler=padding,
            num_experts=experts,
            layout=Padded(pad_to_multiple_of=multiple),
        )
        assert layout.seq_len == batch["attention_mask"].shape[1]
        assert layout.dtype == batch["rollout_expert_indices"].numpy().dtype
        assert (layout.batch_size, layout.num_tokens) == (9, sum(counts))
    assert global_geometry(torch.tensor([3, 4]), [torch.int16, "uint8"]).dtype == np.int16
    with pytest.raises(AttributeError):
        layout.seq_len = 1  # frozen


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        (([], [np.uint8]), {}, ValueError, "token_counts must hold at least one token count"),
        (([3, 0], [np.uint8]), {}, ValueError, r"token_counts\[1\] must be >= 1, got 0"),
        (([3], []), {}, ValueError, "expected at least one route dtype"),
        (([3], [np.int64]), {}, ValueError, r"dtypes\[0\] must be uint8, int16 or int32"),
        (([3], [np.uint8]), {"filler": "balanced"}, ValueError, "needs num_experts"),
        (([3], [np.uint8]), {"pad_to_multiple_of": 0}, ValueError, "pad_to_multiple_of must be >= 1"),
    ],
)
def test_global_geometry_refuses_bad_metadata(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        global_geometry(*args, **torch_r3_options(**kwargs))


@pytest.mark.parametrize("layers", [[1, 2], [3, 0, 2]])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_every_output_byte_is_written_with_seq_len_dtype_and_layers(layers, layout):
    # Caller-owned buffers full of garbage: nothing of it may survive the single write.
    rng = np.random.default_rng(12)
    routes = [router_routes(rng, r, 4, 2, num_experts=5) for r in (2, 0, 5)]
    counts, ids = [3, 4, 6], [7, 2, 40]
    kw = {"layout": layout, "keep_layers": layers, "dtype": np.int16, "filler": "balanced", "num_experts": 5}
    if layout == "padded":
        kw["seq_len"] = 9
    first = collate_routes(routes, counts, sample_ids=ids, **torch_r3_options(**kw))
    out = {k: torch.full_like(v, 77) if v.dtype != torch.bool else torch.ones_like(v) for k, v in first.items()}
    got = collate_routes(routes, counts, sample_ids=ids, out=out, **torch_r3_options(**kw))
    kw.pop("dtype")
    want = reference_collate_routes(routes, counts, dtype=np.int16, sample_ids=ids, **kw)
    assert_batch_equal(got, want)
