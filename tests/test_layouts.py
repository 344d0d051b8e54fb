"""The trainers' layouts (right padding, prompt-left/response-right, aligned packing, zeros filler, nested).

Each is checked against the independent reference collator
(`tests/reference_collate.py`, built position by position), through
`collate_routes`, `R3Collator` and `ShardCollator`, whose micro-batches must be
bit-identical to their part of the global batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.reference_collate import (
    ROUTE_DTYPES as ORDER,
    assert_batch_equal,
    reference_collate_routes,
    reference_r3_collator,
)
from tests.samples import EXPERTS_IN, route_samples, router_routes
from tests.spelling import torch_r3_options
from torch_r3 import (
    Packed,
    Padded,
    PromptResponse,
    R3Collator,
    ShardCollator,
    as_nested,
    collate_routes,
    global_geometry,
    plan_microbatches,
)

L, K, EXPERTS = 3, 2, 7

# Each new layout as collator options; prompt_response's widths are filled in per batch.
LAYOUTS = {
    "right": {"layout": "padded", "padding_side": "right"},
    "right_multiple": {"layout": "padded", "padding_side": "right", "pad_to_multiple_of": 4},
    "prompt_response": {"layout": "prompt_response"},
    "packed_aligned": {"layout": "packed", "pad_to_multiple_of": 4},
    "packed_aligned_1": {"layout": "packed", "pad_to_multiple_of": 1},
    "left_zeros": {"layout": "padded", "filler": "zeros"},
    "packed_zeros": {"layout": "packed", "filler": "zeros", "pad_to_multiple_of": 3},
}


def make_samples(rng, B=None):
    """The shared samples, every fourth one int16, each with a prompt length; `B` drawn in 4..11 when `None`."""
    return route_samples(
        rng,
        n=(4, 12) if B is None else B,
        max_tokens=19,
        num_layers=L,
        topk=K,
        num_experts=EXPERTS,
        dtypes=(np.uint8, np.int16, np.uint8, np.uint8),
        extras=("loss_mask", "prompt_length", "reward"),
    )


def options_for(name, samples, filler=None):
    opts = dict(LAYOUTS[name])
    if opts["layout"] == "prompt_response":
        opts["prompt_width"] = max(s["prompt_length"] for s in samples) + 2
        opts["response_width"] = max(len(s["input_ids"]) - s["prompt_length"] for s in samples) + 1
    if filler is not None and "filler" not in opts:
        opts["filler"] = filler
    if opts.get("filler") == "balanced":
        opts["num_experts"] = EXPERTS
    return opts


def reference_for(samples, opts, **geometry):
    kw = {k: v for k, v in opts.items() if k not in ("pad_token_id", "pad_keys")}
    return reference_r3_collator(samples, pad_token_id=3, pad_keys={"loss_mask": (-1.0, np.float32)}, **kw, **geometry)


# ---------------------------------------------------------------------------
# collate_routes against the reference
# ---------------------------------------------------------------------------


def test_right_padding_puts_the_tokens_first_and_the_padding_after():
    a = np.array([[[5, 6]], [[7, 8]]], dtype=np.uint8)
    b = np.array([[[9, 1]]], dtype=np.uint8)
    batch = collate_routes([a, b], [2, 3], layout=Padded(side="right"))
    assert batch["rollout_expert_indices"][:, :, 0].tolist() == [[[5, 6], [7, 8], [0, 1]], [[9, 1], [0, 1], [0, 1]]]
    assert batch["router_padding_mask"].tolist() == [[False, False, True], [False, True, True]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_prompt_response_places_each_prompt_before_p_and_each_response_from_p():
    # sample 0: prompt 1 token, response 2 (rows for 2 of its 3 tokens); sample 1: prompt 2, response 0.
    a = np.array([[[5, 6]], [[7, 8]]], dtype=np.uint8)
    b = np.array([[[9, 1]]], dtype=np.uint8)
    batch = collate_routes(
        [a, b], [3, 2], layout=PromptResponse(prompt_width=2, response_width=3), prompt_lengths=[1, 2]
    )
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert batch["router_padding_mask"].tolist() == [[True, False, False, True, True], [False, True, True, True, True]]
    assert batch["rollout_expert_indices"][0, 1:3, 0].tolist() == [[5, 6], [7, 8]]


def test_aligned_packing_gives_real_and_aligned_offsets():
    a = np.array([[[5, 6]], [[7, 8]]], dtype=np.uint8)
    b = np.array([[[9, 1]]], dtype=np.uint8)
    batch = collate_routes(
        [a, b],
        [2, 5],
        layout=Packed(pad_to_multiple_of=4),
    )
    assert batch["cu_seqlens"].tolist() == [0, 2, 7]
    assert batch["cu_seqlens_padded"].tolist() == [0, 4, 12]
    assert batch["cu_seqlens"].dtype == batch["cu_seqlens_padded"].dtype == torch.int32
    assert batch["router_padding_mask"].tolist() == [False, False, True, True, False] + [True] * 7
    unaligned = collate_routes([a, b], [2, 5], layout="packed")
    assert "cu_seqlens_padded" not in unaligned  # without pad_to_multiple_of: today's packed layout


def test_zeros_filler_writes_zero_rows_and_never_widens():
    a = np.array([[[5, 6]], [[7, 8]]], dtype=np.uint8)
    batch = collate_routes([a], [4], filler="zeros", layout=Padded(pad_to_multiple_of=3))
    routes = batch["rollout_expert_indices"]
    assert routes.dtype == torch.uint8
    assert routes[0, :, 0].tolist() == [[0, 0], [0, 0], [5, 6], [7, 8], [0, 0], [0, 0]]
    wide = collate_routes([np.zeros((1, 1, 300), np.uint8)], [2], filler="zeros")  # arange would need int16
    assert wide["rollout_expert_indices"].dtype == torch.uint8


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_property_every_new_layout_matches_the_reference(data):
    B = data.draw(st.integers(1, 5))
    L_, K_ = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    E = data.draw(st.integers(K_, K_ + 9))
    layout = data.draw(st.sampled_from(["padded", "prompt_response", "packed"]))
    filler = data.draw(st.sampled_from(["arange", "balanced", "zeros"]))
    counts, routes, prompts = [], [], []
    for _ in range(B):
        n = data.draw(st.integers(1, 12))
        dtype = data.draw(st.sampled_from(ORDER))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
        rows = data.draw(st.integers(0, n))
        experts = E if filler == "balanced" else EXPERTS_IN[dtype]  # num_experts=E checks every id against E
        routes.append(router_routes(rng, rows, L_, K_, num_experts=experts, dtype=dtype))
        counts.append(n)
        prompts.append(data.draw(st.integers(0, n)))
    kw: dict = {"layout": layout, "filler": filler, "num_experts": E if filler == "balanced" else None}
    if layout == "padded":
        kw["padding_side"] = data.draw(st.sampled_from(["left", "right"]))
        kw["pad_to_multiple_of"] = data.draw(st.sampled_from([None, 1, 3, 8]))
        if data.draw(st.booleans()):
            kw["seq_len"] = -(-(max(counts) + data.draw(st.integers(0, 3))) // (kw["pad_to_multiple_of"] or 1)) * (
                kw["pad_to_multiple_of"] or 1
            )
    elif layout == "packed":
        kw["pad_to_multiple_of"] = data.draw(st.sampled_from([None, 1, 2, 4, 8]))
    else:
        kw["prompt_width"] = max(prompts) + data.draw(st.integers(0, 3))
        kw["response_width"] = max(n - p for n, p in zip(counts, prompts)) + data.draw(st.integers(0, 3))
        kw["response_width"] = max(kw["response_width"], 1)
        kw["prompt_width"] = max(kw["prompt_width"], 1)
        kw["prompt_lengths"] = prompts
    if data.draw(st.booleans()):
        kw["keep_layers"] = data.draw(
            st.permutations(range(L_)).flatmap(lambda p: st.integers(1, L_).map(lambda k: p[:k]))
        )
    if data.draw(st.booleans()):
        kw["sample_ids"] = data.draw(st.lists(st.integers(0, 10_000), min_size=B, max_size=B, unique=True))
    got = collate_routes(routes, counts, **torch_r3_options(**kw))
    assert_batch_equal(got, reference_collate_routes(routes, counts, **kw))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("filler", ["arange", "balanced"])
def test_collator_matches_the_reference_for_every_new_layout(name, filler):
    samples = make_samples(np.random.default_rng(7))
    opts = options_for(name, samples, filler)
    got = R3Collator(pad_token_id=3, pad_keys={"loss_mask": -1.0}, **torch_r3_options(**opts))(samples)
    assert_batch_equal(got, reference_for(samples, opts))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_out_buffers_of_a_new_layout_are_fully_overwritten(name):
    samples = make_samples(np.random.default_rng(3), B=5)
    opts = options_for(name, samples)
    routes = [s["routes"] for s in samples]
    counts = [len(s["input_ids"]) for s in samples]
    extra = {"prompt_lengths": [s["prompt_length"] for s in samples]} if opts["layout"] == "prompt_response" else {}
    fresh = collate_routes(routes, counts, **torch_r3_options(**opts), **extra)
    dirty = {k: torch.full_like(v, 1) for k, v in fresh.items()}  # 1 everywhere: no byte may survive
    got = collate_routes(routes, counts, **torch_r3_options(**opts), **extra, out=dirty)
    for key, value in fresh.items():
        assert got[key] is dirty[key] and torch.equal(value, got[key]), key


# ---------------------------------------------------------------------------
# ShardCollator: each micro-batch is its part of the global batch
# ---------------------------------------------------------------------------


def expected_part(full, indices, layers, layout):
    if layout != "packed":
        want = {k: v[indices] for k, v in full.items()}
        want["rollout_expert_indices"] = want["rollout_expert_indices"][:, :, layers]
        return want
    spans = full.get("cu_seqlens_padded", full["cu_seqlens"]).tolist()
    real = full["cu_seqlens"].tolist()
    want = {"reward": full["reward"][indices], "prompt_length": full["prompt_length"][indices]}
    for key in ("rollout_expert_indices", "router_padding_mask", "input_ids", "loss_mask"):
        want[key] = torch.cat([full[key][spans[i] : spans[i + 1]] for i in indices])
    want["rollout_expert_indices"] = want["rollout_expert_indices"][:, layers]
    want["cu_seqlens"] = torch.tensor([0, *np.cumsum([real[i + 1] - real[i] for i in indices])], dtype=torch.int32)
    if "cu_seqlens_padded" in full:
        want["cu_seqlens_padded"] = torch.tensor(
            [0, *np.cumsum([spans[i + 1] - spans[i] for i in indices])], dtype=torch.int32
        )
    return want


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("filler", ["arange", "balanced"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_microbatch_equals_its_part_of_the_global_batch(name, filler, seed):
    samples = make_samples(np.random.default_rng(seed), B=int(np.random.default_rng(seed).integers(8, 14)))
    counts = [len(s["input_ids"]) for s in samples]
    opts = options_for(name, samples, filler)
    opts.update(pad_token_id=3, pad_keys={"loss_mask": -1.0})
    full = R3Collator(**torch_r3_options(**opts))(samples)
    assert_batch_equal(full, reference_for(samples, opts))
    layout, multiple = opts["layout"], opts.get("pad_to_multiple_of")
    geometry = global_geometry(
        counts,
        {s["routes"].dtype for s in samples},
        filler=opts.get("filler", "arange"),
        num_experts=opts.get("num_experts"),
        layout=torch_r3_options(layout="packed" if layout == "packed" else "padded", pad_to_multiple_of=multiple)[
            "layout"
        ],
    )
    if layout == "packed":
        assert geometry.num_tokens == full["rollout_expert_indices"].shape[0]
    seq_len = geometry.seq_len if layout == "padded" else None
    plan = plan_microbatches(counts, dp_size=2, micro_batch_size=3, pad_to_multiple_of=multiple)
    for rank in range(2):
        for layers in ([0, 1], [2]):
            shard = ShardCollator(
                lambda idx: [samples[i] for i in idx],
                plan[rank],
                dtype=geometry.dtype,
                keep_layers=layers,
                **torch_r3_options(seq_len=seq_len, **opts),
            )
            for indices, batch in zip(plan[rank], list(shard)):
                want = expected_part(full, indices, layers, layout)
                assert set(batch) == set(want)
                for key, value in want.items():
                    assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), (rank, indices, key)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_any_plan_of_any_new_layout_slices_the_global_batch(data):
    samples = make_samples(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    counts = [len(s["input_ids"]) for s in samples]
    name = data.draw(st.sampled_from(sorted(LAYOUTS)))
    opts = options_for(name, samples, data.draw(st.sampled_from(["arange", "balanced", "zeros"])))
    opts["pad_keys"] = {"loss_mask": 2.0}
    opts["pad_token_id"] = 0
    full = R3Collator(**torch_r3_options(**opts))(samples)
    layout = opts["layout"]
    geometry = global_geometry(
        counts,
        {s["routes"].dtype for s in samples},
        filler=opts.get("filler", "arange"),
        num_experts=opts.get("num_experts"),
        layout=Padded(pad_to_multiple_of=opts.get("pad_to_multiple_of")),
    )
    dp = data.draw(st.integers(1, 3))
    plan = plan_microbatches(counts, dp_size=dp, micro_batch_size=data.draw(st.none() | st.integers(2, 4)))
    layers = data.draw(st.permutations(range(L)).flatmap(lambda p: st.integers(1, L).map(lambda k: list(p[:k]))))
    for rank in range(dp):
        shard = ShardCollator(
            lambda idx: [samples[i] for i in idx],
            plan[rank],
            dtype=geometry.dtype,
            keep_layers=layers,
            **torch_r3_options(seq_len=geometry.seq_len if layout == "padded" else None, **opts),
        )
        for indices, batch in zip(plan[rank], shard):
            want = expected_part(full, indices, layers, layout)
            assert set(batch) == set(want)
            for key, value in want.items():
                assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), (name, key)


def test_global_geometry_and_the_plan_count_aligned_tokens():
    counts = [3, 5, 8, 1]
    aligned = global_geometry(
        counts,
        {np.uint8},
        layout=Packed(pad_to_multiple_of=4),
    )
    assert (aligned.num_tokens, aligned.seq_len) == (4 + 8 + 8 + 4, 8)
    assert (
        global_geometry(counts, {np.uint8}, layout=Padded(pad_to_multiple_of=4)).num_tokens == 17
    )  # padded: the real tokens
    with pytest.raises(ValueError, match="layout must be one of"):
        global_geometry(counts, {np.uint8}, layout="prompt_response")
    # 4 + 4 = 8 aligned tokens fit a cap of 8; the real counts 3 + 1 would have fit 4.
    plan = plan_microbatches([3, 1, 3, 1], dp_size=1, max_tokens_per_microbatch=8, pad_to_multiple_of=4)
    assert len(plan[0]) == 2 and all(len(mb) == 2 for mb in plan[0])
    assert plan_microbatches([3, 1, 3, 1], dp_size=1, max_tokens_per_microbatch=8) == [[[0, 1, 2, 3]]]
    with pytest.raises(ValueError, match="more than max_tokens_per_microbatch=4"):
        plan_microbatches([3, 5], dp_size=1, max_tokens_per_microbatch=4, pad_to_multiple_of=4)


# ---------------------------------------------------------------------------
# Nested tensors over a packed batch, without a copy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("multiple", [None, 4])
def test_as_nested_wraps_the_packed_values_in_place(multiple):
    samples = make_samples(np.random.default_rng(5), B=6)
    batch = R3Collator(layout=Packed(pad_to_multiple_of=multiple), pad_keys={"loss_mask": -1.0}, pad_token_id=0)(
        samples
    )
    want = reference_r3_collator(
        samples, layout="packed", pad_to_multiple_of=multiple, pad_keys={"loss_mask": (-1.0, np.float32)}
    )
    spans = want.get("cu_seqlens_padded", want["cu_seqlens"])
    for key in ("rollout_expert_indices", "input_ids", "router_padding_mask"):
        values = batch[key]
        nested = as_nested(values, batch["cu_seqlens"], cu_seqlens_padded=batch.get("cu_seqlens_padded"))
        assert nested.is_nested and nested.layout == torch.jagged
        assert nested.values().data_ptr() == values.data_ptr()  # same storage: no copy
        assert nested.values().untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
        parts = nested.unbind()
        assert len(parts) == len(samples)
        for i, (part, s) in enumerate(zip(parts, samples)):
            n = len(s["input_ids"])
            expected = torch.from_numpy(np.ascontiguousarray(want[key][spans[i] : spans[i] + n]))
            assert torch.equal(part, expected), (key, i)
    values = batch["input_ids"]
    nested = as_nested(values, batch["cu_seqlens"], cu_seqlens_padded=batch.get("cu_seqlens_padded"))
    values[int(spans[1])] = -7  # a write through the packed tensor is seen by the nested one
    assert nested.unbind()[1][0].item() == -7


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((torch.zeros(4), [0, 4]), {}, TypeError, "cu_seqlens: expected a torch.Tensor"),
        ((torch.zeros(4), torch.tensor([0.0, 4.0])), {}, TypeError, "int32 or int64"),
        ((torch.zeros(4), torch.tensor([0, 3])), {}, ValueError, "covers 3 rows, the values have 4"),
        ((torch.zeros(4), torch.tensor([1, 4])), {}, ValueError, "starting at 0"),
        ((torch.zeros(4), torch.tensor([0])), {}, ValueError, r"shape \[B \+ 1\] with B >= 1"),
        ((torch.zeros(4, 2).t(), torch.tensor([0, 2])), {}, ValueError, "contiguous"),
        (
            (torch.zeros(8), torch.tensor([0, 5, 6])),
            {"cu_seqlens_padded": torch.tensor([0, 4, 8])},
            ValueError,
            "sequence 0: 5 real tokens in an aligned span of 4",
        ),
        (
            (torch.zeros(8), torch.tensor([0, 1])),
            {"cu_seqlens_padded": torch.tensor([0, 4, 8])},
            ValueError,
            "cu_seqlens has 1 sequences, cu_seqlens_padded 2",
        ),
    ],
)
def test_as_nested_refuses_bad_offsets(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        as_nested(*args, **kwargs)


# ---------------------------------------------------------------------------
# Refusals, naming the sample or the setting
# ---------------------------------------------------------------------------

GOOD = np.zeros((2, 3, 2), np.uint8)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        # each a function: a layout value checks its options where it is built, inside pytest.raises
        (lambda: {"layout": Padded(side="middle")}, ValueError, r"Padded.side must be one of \['left', 'right'\]"),
        (lambda: {"layout": Packed(side="right")}, TypeError, "unexpected keyword argument 'side'"),
        (lambda: {"layout": "prompt_response"}, ValueError, "needs its widths: pass layout=torch_r3.PromptResponse"),
        (lambda: {"layout": PromptResponse(2)}, TypeError, "missing 1 required positional argument: 'response_width'"),
        (
            lambda: {"layout": PromptResponse(0, 2), "prompt_lengths": [1]},
            ValueError,
            "PromptResponse.prompt_width must be >= 1",
        ),
        (lambda: {"layout": PromptResponse(2, 2, seq_len=4)}, TypeError, "unexpected keyword argument 'seq_len'"),
        (
            lambda: {"layout": PromptResponse(2, 2, pad_to_multiple_of=2)},
            TypeError,
            "unexpected keyword argument 'pad_to_multiple_of'",
        ),
        (lambda: {"layout": PromptResponse(2, 2)}, ValueError, "needs each sample's prompt"),
        (
            lambda: {"layout": PromptResponse(1, 4), "prompt_lengths": [2]},
            ValueError,
            "sample 0: prompt of 2 tokens is longer than prompt_width=1",
        ),
        (
            lambda: {"layout": PromptResponse(4, 1), "prompt_lengths": [1]},
            ValueError,
            "sample 0: response of 2 tokens is longer than response_width=1",
        ),
        (
            lambda: {"layout": PromptResponse(4, 4), "prompt_lengths": [4]},
            ValueError,
            r"sample 0: prompt length 4 is outside \[0, 3\]",
        ),
        (
            lambda: {"layout": PromptResponse(4, 4), "prompt_lengths": [1.0]},
            TypeError,
            r"prompt_lengths\[0\] must be an int",
        ),
        (lambda: {"layout": PromptResponse(4, 4), "prompt_lengths": [1, 2]}, ValueError, "expected 1 lengths"),
        (lambda: {"prompt_lengths": [1]}, ValueError, "prompt_lengths applies to torch_r3.PromptResponse only"),
        (lambda: {"filler": "ones"}, ValueError, "filler must be one of"),
    ],
)
def test_bad_layout_settings_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        collate_routes([GOOD], [3], **kwargs())


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (None, TypeError, "sample 1: key 'prompt_length' is None"),
        (1.0, TypeError, "sample 1: 'prompt_length' must be an int prompt length, got float"),
        (True, TypeError, "sample 1: 'prompt_length' must be an int prompt length, got bool"),
        (torch.tensor([1, 2]), TypeError, r"sample 1: 'prompt_length' must be an int prompt length.*shape \[2\]"),
        (torch.tensor(1.0), TypeError, "sample 1: 'prompt_length' must be an int prompt length.*float32"),
        (torch.tensor(True), TypeError, "sample 1: 'prompt_length' must be an int prompt length.*torch.bool"),
        (np.array([1.5]), TypeError, "sample 1: 'prompt_length' must be an int prompt length.*float64"),
        (torch.tensor(1, device="meta"), TypeError, "sample 1: 'prompt_length' must be an int prompt length"),
        (9, ValueError, r"sample 1: prompt length 9 is outside \[0, 2\]"),
    ],
)
def test_the_collator_reads_prompt_lengths_from_the_samples_naming_the_bad_one(value, exc, match):
    samples = [
        {"input_ids": [1, 2, 3], "routes": GOOD, "prompt_length": 1},
        {"input_ids": [4, 5], "routes": GOOD[:1], "prompt_length": value},
    ]
    collator = R3Collator(
        layout=PromptResponse(prompt_width=4, response_width=4),
        pad_token_id=0,
    )
    with pytest.raises(exc, match=match):
        collator(samples)


def test_the_prompt_length_key_is_configurable_and_stays_in_the_batch():
    samples = [
        {"input_ids": [1, 2, 3], "routes": GOOD, "plen": np.int64(2)},
        {"input_ids": [4, 5], "routes": GOOD[:1], "plen": np.int64(0)},
    ]
    batch = R3Collator(
        layout=PromptResponse(prompt_width=2, response_width=2, prompt_length_key="plen"),
        pad_token_id=0,
    )(samples)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [0, 0, 4, 5]]
    assert batch["plen"].tolist() == [2, 0]
    with pytest.raises(ValueError, match="sample 0: missing key 'prompt_length'"):
        R3Collator(
            layout=PromptResponse(prompt_width=2, response_width=2),
            pad_token_id=0,
        )(samples)


def test_the_zero_filler_hint_names_uncaptured_rows_only():
    from torch_r3.replay.checks import check_replayed_ids

    routes = torch.zeros(1, 3, 1, 2, dtype=torch.uint8)  # B=1, T=3, one layer, K=2: every row [0, 0]
    checked = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"row 0, token 0: expert id 0 twice.*filler='zeros'"):
        check_replayed_ids(routes, checked, [0], 8, uncaptured=torch.tensor([[True, False, True]]))
    with pytest.raises(ValueError) as info:  # a captured all-zero row is the engine's, not a filler
        check_replayed_ids(routes, checked, [0], 8, uncaptured=torch.tensor([[False, True, True]]))
    assert "twice" in str(info.value) and "filler" not in str(info.value)


@pytest.mark.parametrize("name", ["prompt_response", "packed_aligned"])
def test_a_new_layout_collated_in_dataloader_workers_equals_the_reference(name):
    # The collator's options travel to spawned workers (pickled), which write into shared memory.
    from torch.utils.data import DataLoader

    samples = make_samples(np.random.default_rng(9), B=8)
    opts = options_for(name, samples, "balanced")
    collator = R3Collator(pad_token_id=3, pad_keys={"loss_mask": -1.0}, **torch_r3_options(**opts))
    loader = DataLoader(samples, batch_size=4, collate_fn=collator, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 2
    for k, batch in enumerate(batches):
        assert batch["rollout_expert_indices"].is_shared()
        part = samples[4 * k : 4 * k + 4]
        assert_batch_equal(batch, reference_for(part, opts, sample_ids=None))
