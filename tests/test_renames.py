"""Every renamed argument, name and module keeps working under its old spelling, with a `DeprecationWarning`.

Each old spelling must give exactly what the new one gives, and passing both
spellings at once is refused.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import torch_r3
from torch_r3 import BufferPool, R3Collator, ShardCollator, collate_routes, global_geometry
from torch_r3.collate.collator import padding_rows

ROUTES = [np.arange(12, dtype=np.uint8).reshape(2, 3, 2) % 5, np.ones((1, 3, 2), np.uint8)]
SAMPLES = [{"input_ids": [1, 2, 3], "routes": ROUTES[0]}, {"input_ids": [4], "routes": ROUTES[1]}]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_collate_routes_padding_and_layers_are_the_old_names_of_filler_and_keep_layers():
    want = collate_routes(ROUTES, [3, 2], filler="balanced", num_experts=5, keep_layers=[2, 0])
    with pytest.deprecated_call() as seen:
        got = collate_routes(ROUTES, [3, 2], padding="balanced", num_experts=5, layers=[2, 0])
    assert sorted(str(w.message) for w in seen) == [
        "collate_routes(layers=) is deprecated; use keep_layers= instead (same meaning)",
        "collate_routes(padding=) is deprecated; use filler= instead (same meaning)",
    ]
    assert all(w.filename == __file__ for w in seen)  # attributed to the caller's line
    _same(got, want)
    with pytest.raises(TypeError, match=r"collate_routes: pass filler= only"):
        collate_routes(ROUTES, [3, 2], padding="arange", filler="balanced", num_experts=5)
    with pytest.raises(TypeError, match=r"collate_routes: pass keep_layers= only"):
        collate_routes(ROUTES, [3, 2], layers=[0], keep_layers=[1])


def test_collators_take_the_old_names_too():
    want = R3Collator(filler="balanced", num_experts=5, keep_layers=[1], pad_token_id=0)(SAMPLES)
    with (
        pytest.deprecated_call(match=r"R3Collator\(padding=\)"),
        pytest.deprecated_call(match=r"R3Collator\(layers=\)"),
    ):
        got = R3Collator(padding="balanced", num_experts=5, layers=[1], pad_token_id=0)(SAMPLES)
    _same(got, want)
    shard = list(ShardCollator(lambda idx: [SAMPLES[i] for i in idx], [[0, 1]], keep_layers=[1], pad_token_id=0))
    with pytest.deprecated_call(match=r"ShardCollator\(layers=\)"):
        old = list(ShardCollator(lambda idx: [SAMPLES[i] for i in idx], [[0, 1]], layers=[1], pad_token_id=0))
    _same(old[0], shard[0])


def test_r3collator_takes_a_buffer_pool_like_collate_routes_but_not_with_cache_bytes():
    pool = BufferPool()
    collator = R3Collator(memory=torch_r3.Memory(buffers=pool), pad_token_id=0)
    assert collator.buffers is pool
    _same(collator(SAMPLES), R3Collator(pad_token_id=0)(SAMPLES))
    with pytest.raises(ValueError, match="pass buffers= or cache_bytes=, not both"):
        torch_r3.Memory(buffers=pool, cache_bytes=0)
    with pytest.raises(TypeError, match="buffers must be None or a torch_r3.BufferPool, got dict"):
        torch_r3.Memory(buffers={})
    with pytest.raises(ValueError, match="collate_routes: Memory.cache_bytes bounds R3Collator's own pool"):
        collate_routes(ROUTES, [3, 2], memory=torch_r3.Memory(cache_bytes=0))


def test_geometry_old_names_and_module():
    want = global_geometry([3, 2], [np.uint8], filler="balanced", num_experts=300)
    with pytest.deprecated_call(match=r"global_geometry\(padding=\)"):
        assert global_geometry([3, 2], [np.uint8], padding="balanced", num_experts=300) == want
    with pytest.deprecated_call(match=r"torch_r3.global_layout is deprecated; use torch_r3.global_geometry"):
        assert torch_r3.global_layout is global_geometry
    with pytest.deprecated_call(match=r"torch_r3.BatchLayout is deprecated; use torch_r3.BatchGeometry"):
        assert torch_r3.BatchLayout is torch_r3.BatchGeometry
    layout = importlib.import_module("torch_r3.collate.layout")  # importing the old module is silent; reading warns
    with pytest.deprecated_call(match=r"torch_r3.collate.layout.global_layout is deprecated"):
        assert layout.global_layout is global_geometry
    with pytest.raises(AttributeError):
        layout.nothing_here  # noqa: B018


def test_padding_rows_takes_the_old_name():
    want = padding_rows([0, 1], 1, 2, filler="balanced", num_experts=3)
    with pytest.deprecated_call(match=r"padding_rows\(padding=\)"):
        np.testing.assert_array_equal(padding_rows([0, 1], 1, 2, padding="balanced", num_experts=3), want)


def test_the_native_protocol_module_keeps_its_old_name():
    from torch_r3.rollout.protocols import native

    old = importlib.import_module("torch_r3.rollout.protocols.torch_r3")
    with pytest.deprecated_call(match=r"torch_r3.rollout.protocols.torch_r3.GENERATE_PATH is deprecated"):
        assert old.GENERATE_PATH == native.GENERATE_PATH


# --------------------------------------------------------------------------
# The layout and memory keywords became values (`layout=Padded(...)`, `memory=Memory(...)`)
# --------------------------------------------------------------------------

PROMPTS = [{**s, "prompt_length": 1} for s in SAMPLES]
# (old keywords, the same thing in the new spelling, the spelling the warning names)
OLD_LAYOUT_KEYWORDS = [
    ({"padding_side": "right"}, {"layout": torch_r3.Padded(side="right")}, "layout=torch_r3.Padded(side='right')"),
    ({"seq_len": 6}, {"layout": torch_r3.Padded(seq_len=6)}, "layout=torch_r3.Padded(seq_len=6)"),
    (
        {"pad_to_multiple_of": 4},
        {"layout": torch_r3.Padded(pad_to_multiple_of=4)},
        "layout=torch_r3.Padded(pad_to_multiple_of=4)",
    ),
    (
        {"layout": "packed", "pad_to_multiple_of": 4},
        {"layout": torch_r3.Packed(pad_to_multiple_of=4)},
        "layout=torch_r3.Packed(pad_to_multiple_of=4)",
    ),
    ({"workers": 1}, {"memory": torch_r3.Memory(workers=1)}, "memory=torch_r3.Memory(workers=1)"),
    ({"pin_memory": False}, {"memory": torch_r3.Memory(pin_memory=False)}, "memory=torch_r3.Memory(pin_memory=False)"),
    (
        {"max_output_bytes": 1 << 20},
        {"memory": torch_r3.Memory(max_output_bytes=1 << 20)},
        "memory=torch_r3.Memory(max_output_bytes=1048576)",
    ),
]


def _warned(seen: list, where: str, new: str) -> None:
    messages = [str(w.message) for w in seen]
    assert any(m.startswith(f"{where}(") and f"use {new} instead" in m for m in messages), messages
    assert all(w.filename == __file__ for w in seen)  # attributed to the caller's line


@pytest.mark.parametrize(("old", "new", "named"), OLD_LAYOUT_KEYWORDS)
def test_collate_routes_old_layout_and_memory_keywords_warn_and_give_the_same_batch(old, new, named):
    want = collate_routes(ROUTES, [3, 2], **new)
    with pytest.deprecated_call() as seen:
        got = collate_routes(ROUTES, [3, 2], **old)
    _warned(seen, "collate_routes", named)
    _same(got, want)


@pytest.mark.parametrize(("old", "new", "named"), OLD_LAYOUT_KEYWORDS)
def test_collators_old_layout_and_memory_keywords_warn_and_give_the_same_batch(old, new, named):
    want = R3Collator(**new, pad_token_id=0)(SAMPLES)
    with pytest.deprecated_call() as seen:
        got = R3Collator(**old, pad_token_id=0)(SAMPLES)
    _warned(seen, "R3Collator", named)
    _same(got, want)
    fetch = lambda idx: [SAMPLES[i] for i in idx]  # noqa: E731
    want = next(iter(ShardCollator(fetch, [[0, 1]], **new, pad_token_id=0)))
    with pytest.deprecated_call() as seen:
        got = next(iter(ShardCollator(fetch, [[0, 1]], **old, pad_token_id=0)))
    _warned(seen, "ShardCollator", named)
    _same(got, want)


def test_the_prompt_response_keywords_became_one_value():
    layout = torch_r3.PromptResponse(prompt_width=2, response_width=3, prompt_length_key="p")
    samples = [{**s, "p": 1} for s in SAMPLES]
    want = R3Collator(layout=layout, pad_token_id=0)(samples)
    with pytest.deprecated_call() as seen:
        got = R3Collator(
            layout="prompt_response", prompt_width=2, response_width=3, prompt_length_key="p", pad_token_id=0
        )(samples)
    assert sorted(str(w.message).split(";")[0] for w in seen) == [
        "R3Collator(prompt_length_key=) is deprecated",
        "R3Collator(prompt_width=) is deprecated",
        "R3Collator(response_width=) is deprecated",
    ]
    _same(got, want)
    want = collate_routes(ROUTES, [3, 2], layout=torch_r3.PromptResponse(2, 3), prompt_lengths=[1, 1])
    with pytest.deprecated_call() as seen:
        got = collate_routes(
            ROUTES, [3, 2], layout="prompt_response", prompt_width=2, response_width=3, prompt_lengths=[1, 1]
        )
    _warned(seen, "collate_routes", "layout=torch_r3.PromptResponse(prompt_width=2)")
    _same(got, want)


def test_cache_bytes_and_buffers_moved_into_memory():
    pool = BufferPool()
    with pytest.deprecated_call(
        match=r"R3Collator\(buffers=\) is deprecated; use memory=torch_r3.Memory\(buffers=\.\.\.\)"
    ):
        collator = R3Collator(buffers=pool, pad_token_id=0)
    assert collator.buffers is pool and R3Collator(memory=torch_r3.Memory(buffers=pool), pad_token_id=0).buffers is pool
    with pytest.deprecated_call(match=r"use memory=torch_r3.Memory\(cache_bytes=0\)"):
        assert R3Collator(cache_bytes=0, pad_token_id=0).buffers.cache_bytes == 0
    want = collate_routes(ROUTES, [3, 2], memory=torch_r3.Memory(buffers=pool))
    with pytest.deprecated_call(match=r"collate_routes\(buffers=\)"):
        _same(collate_routes(ROUTES, [3, 2], buffers=pool), want)
    with pytest.deprecated_call(match=r"ShardCollator\(buffers=\)"):
        shard = ShardCollator(lambda idx: [SAMPLES[i] for i in idx], [[0, 1]], buffers=pool, pad_token_id=0)
    assert shard.collator.buffers is pool


def test_an_old_keyword_next_to_the_value_that_holds_it_is_refused():
    with pytest.raises(TypeError, match=r"R3Collator: pass seq_len= inside layout= only"):
        R3Collator(layout=torch_r3.Padded(), seq_len=4, pad_token_id=0)
    with pytest.raises(TypeError, match=r"collate_routes: pass workers= inside memory= only"):
        collate_routes(ROUTES, [3, 2], memory=torch_r3.Memory(pin_memory=False), workers=1)
    with pytest.raises(ValueError, match=r"R3Collator: seq_len= applies to torch_r3.Padded only, got layout='packed'"):
        R3Collator(layout="packed", seq_len=4, pad_token_id=0)
    with pytest.raises(ValueError, match=r"padding_side= applies to torch_r3.Padded only"):
        collate_routes(ROUTES, [3, 2], layout="packed", padding_side="right")
    # collate_routes never took these: still unknown keywords, as Python says it
    with pytest.raises(TypeError, match=r"collate_routes got an unexpected keyword argument 'cache_bytes'"):
        collate_routes(ROUTES, [3, 2], cache_bytes=0)
    with pytest.raises(TypeError, match=r"collate_routes got an unexpected keyword argument 'prompt_length_key'"):
        collate_routes(ROUTES, [3, 2], prompt_length_key="p")
    with pytest.raises(TypeError, match=r"R3Collator got an unexpected keyword argument 'seq_length'"):
        R3Collator(seq_length=4, pad_token_id=0)


def test_global_geometry_and_collate_selections_take_the_layout_value():
    want = global_geometry([3, 9, 5], [np.uint8], layout=torch_r3.Packed(pad_to_multiple_of=4))
    with pytest.deprecated_call(match=r"global_geometry\(pad_to_multiple_of=\) is deprecated; use layout=torch_r3"):
        assert global_geometry([3, 9, 5], [np.uint8], layout="packed", pad_to_multiple_of=4) == want
    from torch_r3.indexer import IndexerSelections, collate_selections

    sel = IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 0]]]))
    want = collate_selections([sel], [4], layout=torch_r3.Padded(side="right", seq_len=6))
    with pytest.deprecated_call() as seen:
        got = collate_selections([sel], [4], padding_side="right", seq_len=6, workers=1)
    assert len(seen) == 3
    _warned(seen, "collate_selections", "layout=torch_r3.Padded(seq_len=6)")
    _same(got, want)


def test_the_verl_helpers_take_the_layout_and_memory_values():
    from torch_r3.integrations.verl import agent_loop

    layout = torch_r3.PromptResponse(prompt_width=2, response_width=3)
    want = agent_loop.padded_routed_experts(ROUTES, [1, 1], [2, 1], layout=layout)
    with pytest.deprecated_call() as seen:
        got = agent_loop.padded_routed_experts(ROUTES, [1, 1], [2, 1], prompt_width=2, response_width=3, workers=1)
    _warned(seen, "padded_routed_experts", "memory=torch_r3.Memory(workers=1)")
    _same(got, want)
    with pytest.raises(TypeError, match=r"padded_routed_experts needs layout=torch_r3.PromptResponse"):
        agent_loop.padded_routed_experts(ROUTES, [1, 1], [2, 1])
    want_nested = agent_loop.nested_routed_experts(ROUTES, [3, 2])
    with pytest.deprecated_call(match=r"nested_routed_experts\(workers=\)"):
        got_nested = agent_loop.nested_routed_experts(ROUTES, [3, 2], workers=1)
    for a, b in zip(got_nested, want_nested):
        assert torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
