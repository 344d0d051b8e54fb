"""The collator's face: a layout is one value (`Padded`, `Packed`, `PromptResponse`), memory another (`Memory`).

Each value checks its own options where it is built, with its own messages;
the collators take the same `layout=` and `memory=`, and no layout option is a
parameter of its own any more (the old keywords are `**deprecated`, see
tests/test_renames.py).
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch

import torch_r3
from torch_r3 import Memory, Packed, Padded, PromptResponse, R3Collator, ShardCollator, collate_routes
from torch_r3.indexer import collate_selections
from torch_r3.integrations.skyrl import worker as skyrl_worker
from torch_r3.integrations.verl import agent_loop, engine

LAYOUT_OPTIONS = {f.name for cls in (Padded, Packed, PromptResponse) for f in dataclasses.fields(cls)}
OLD_LAYOUT_KEYWORDS = {"padding_side", "pad_to_multiple_of", "seq_len", "prompt_width", "response_width"}
MEMORY_OPTIONS = {f.name for f in dataclasses.fields(Memory)}


def _named(obj: object) -> list[str]:
    """The parameters of `obj` that are not deprecated: every one but the `**deprecated` catch-all."""
    params = inspect.signature(obj).parameters.values()  # type: ignore[arg-type]
    return [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]


def test_r3collator_has_at_most_12_parameters_that_are_not_deprecated():
    assert _named(R3Collator) == [
        "routes_key",
        "tokens_key",
        "layout",
        "pad_token_id",
        "pad_keys",
        "filler",
        "num_experts",
        "dtype",
        "keep_layers",
        "compact",
        "memory",
        "extra_dtypes",
    ]
    assert len(_named(R3Collator)) <= 12
    assert len(_named(collate_routes)) <= 14  # + routes, token_counts and the per-call prompt_lengths, sample_ids, out


@pytest.mark.parametrize(
    "func",
    [
        R3Collator,
        collate_routes,
        ShardCollator,
        collate_selections,
        torch_r3.global_geometry,
        skyrl_worker.microbatch,
        agent_loop.padded_routed_experts,
        agent_loop.nested_routed_experts,
        engine.microbatch,
    ],
)
def test_layout_and_memory_options_are_reachable_only_through_their_values(func):
    named = set(_named(func))
    assert not named & (LAYOUT_OPTIONS | OLD_LAYOUT_KEYWORDS) - {"pad_token_id"}, named
    assert not named & MEMORY_OPTIONS, named
    assert "memory" in named or func is torch_r3.global_geometry  # it allocates nothing


@pytest.mark.parametrize(
    ("build", "exc", "match"),
    [
        (lambda: Padded(side="middle"), ValueError, r"Padded.side must be one of \['left', 'right'\], got 'middle'"),
        (lambda: Padded(pad_to_multiple_of=0), ValueError, r"Padded.pad_to_multiple_of must be >= 1, got 0"),
        (lambda: Padded(seq_len=2.0), TypeError, r"Padded.seq_len must be an int, got float"),
        (lambda: Padded(seq_len=6, pad_to_multiple_of=4), ValueError, r"seq_len=6 is not a multiple of .*=4"),
        (lambda: Packed(pad_to_multiple_of=True), TypeError, r"Packed.pad_to_multiple_of must be an int, got bool"),
        (lambda: PromptResponse(0, 4), ValueError, r"PromptResponse.prompt_width must be >= 1, got 0"),
        (lambda: PromptResponse(4, None), TypeError, r"PromptResponse.response_width must be an int, got NoneType"),
        (lambda: PromptResponse(1, 1, prompt_length_key=3), TypeError, r"prompt_length_key must be a str, got int"),
        (lambda: Memory(workers=0), ValueError, r"workers must be >= 1, got 0"),
        (lambda: Memory(pin_memory="yes"), TypeError, r"pin_memory must be None, True or False"),
        (lambda: Memory(cache_bytes=-1), ValueError, r"cache_bytes must be >= 0, got -1"),
        (lambda: Memory(max_output_bytes=0), ValueError, r"max_output_bytes must be >= 1, got 0"),
        (lambda: Memory(buffers={}), TypeError, r"buffers must be None or a torch_r3.BufferPool, got dict"),
        (
            lambda: Memory(buffers=torch_r3.BufferPool(), cache_bytes=0),
            ValueError,
            r"pass buffers= or cache_bytes=, not both",
        ),
    ],
)
def test_each_value_checks_its_options_where_it_is_built(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_values_are_frozen_and_normalised():
    layout = Padded(side="right", pad_to_multiple_of=np.int64(4))
    assert type(layout.pad_to_multiple_of) is int and layout == Padded("right", 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.side = "left"  # type: ignore[misc]
    assert Memory(pin_memory=np.bool_(False)).pin_memory is False
    assert PromptResponse(2, 3).width == 5


@pytest.mark.parametrize(
    ("layout", "where", "exc", "match"),
    [
        ("ragged", R3Collator, ValueError, r"^layout must be one of \['padded', 'packed'\], got 'ragged'"),
        (
            "prompt_response",
            R3Collator,
            ValueError,
            r"layout='prompt_response' needs its widths: pass layout=torch_r3.PromptResponse",
        ),
        (3, R3Collator, TypeError, r"R3Collator: layout must be torch_r3.Padded or torch_r3.Packed or"),
        (PromptResponse(2, 2), collate_selections, ValueError, r"layout must be torch_r3.Padded or torch_r3.Packed"),
        (Packed(pad_to_multiple_of=2), collate_selections, ValueError, r"with pad_to_multiple_of is not supported"),
        (PromptResponse(2, 2), torch_r3.global_geometry, ValueError, r"global_geometry: layout must be"),
        (Padded(seq_len=4), torch_r3.global_geometry, ValueError, r"global_geometry computes seq_len"),
        (Padded(), engine.microbatch, ValueError, r"microbatch: layout must be torch_r3.Packed"),
    ],
)
def test_a_layout_a_collator_cannot_write_is_refused_naming_it(layout, where, exc, match):
    if where is R3Collator:
        with pytest.raises(exc, match=match):
            R3Collator(layout=layout, pad_token_id=0)
        return
    args = {
        collate_selections: ([], []),
        torch_r3.global_geometry: ([3], [np.uint8]),
        engine.microbatch: (None, None),
    }[where]
    with pytest.raises(exc, match=match):
        where(*args, layout=layout)


def test_the_strings_mean_the_default_values():
    routes = [np.arange(12, dtype=np.uint8).reshape(2, 3, 2) % 5, np.ones((1, 3, 2), np.uint8)]
    for name, value in (("padded", Padded()), ("packed", Packed())):
        a = collate_routes(routes, [3, 2], layout=name)
        b = collate_routes(routes, [3, 2], layout=value)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert R3Collator(layout="packed", pad_token_id=0).layout == Packed()


def test_memory_with_defaults_fills_only_what_is_unset():
    assert Memory().with_defaults(pin_memory=False) == Memory(pin_memory=False)
    assert Memory(pin_memory=True).with_defaults(pin_memory=False) == Memory(pin_memory=True)


def test_collate_selections_takes_the_memory_bound():
    from torch_r3.indexer import IndexerSelections

    sel = IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 0]]]))
    # [1, 64, 1, 2] int16 + two [1, 64] masks (bool, int64): 256 + 64 + 512 bytes
    assert collate_selections([sel], [4], layout=Padded(seq_len=64), memory=Memory(max_output_bytes=832))
    with pytest.raises(ValueError, match=r"would allocate 832 bytes .* more than the bound of 831 bytes"):
        collate_selections([sel], [4], layout=Padded(seq_len=64), memory=Memory(max_output_bytes=831))
    with pytest.raises(ValueError, match=r"Memory.buffers and Memory.cache_bytes are not supported"):
        collate_selections([sel], [4], memory=Memory(cache_bytes=0))


def test_pad_token_id_is_required_as_the_tokenizer_gives_it():
    # Issue 36: with pad_token_id omitted the collator padded input_ids with 0, a real token of most
    # vocabularies, without a word. It is required now, as DataCollatorWithPadding takes it from the tokenizer.
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'pad_token_id'"):
        R3Collator()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'pad_token_id'"):
        ShardCollator(lambda idx: [], [[0]])
    with pytest.raises(TypeError, match=r"pad_token_id=None: the tokenizer has no pad token"):
        R3Collator(pad_token_id=None)  # type: ignore[arg-type]
    samples = [
        {"input_ids": [5, 6], "routes": np.zeros((1, 1, 2), np.uint8)},
        {"input_ids": [7], "routes": np.zeros((0, 1, 2), np.uint8)},
    ]
    assert R3Collator(pad_token_id=9)(samples)["input_ids"].tolist() == [[5, 6], [9, 7]]
