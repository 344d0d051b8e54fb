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
from torch_r3.collate import padding_rows

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
    want = R3Collator(filler="balanced", num_experts=5, keep_layers=[1])(SAMPLES)
    with (
        pytest.deprecated_call(match=r"R3Collator\(padding=\)"),
        pytest.deprecated_call(match=r"R3Collator\(layers=\)"),
    ):
        got = R3Collator(padding="balanced", num_experts=5, layers=[1])(SAMPLES)
    _same(got, want)
    shard = list(ShardCollator(lambda idx: [SAMPLES[i] for i in idx], [[0, 1]], keep_layers=[1]))
    with pytest.deprecated_call(match=r"ShardCollator\(layers=\)"):
        old = list(ShardCollator(lambda idx: [SAMPLES[i] for i in idx], [[0, 1]], layers=[1]))
    _same(old[0], shard[0])


def test_r3collator_takes_a_buffer_pool_like_collate_routes_but_not_with_cache_bytes():
    pool = BufferPool()
    collator = R3Collator(buffers=pool)
    assert collator.buffers is pool
    _same(collator(SAMPLES), R3Collator()(SAMPLES))
    with pytest.raises(ValueError, match="pass buffers= or cache_bytes=, not both"):
        R3Collator(buffers=pool, cache_bytes=0)
    with pytest.raises(TypeError, match="buffers must be None or a torch_r3.BufferPool, got dict"):
        R3Collator(buffers={})


def test_geometry_old_names_and_module():
    want = global_geometry([3, 2], [np.uint8], filler="balanced", num_experts=300)
    with pytest.deprecated_call(match=r"global_geometry\(padding=\)"):
        assert global_geometry([3, 2], [np.uint8], padding="balanced", num_experts=300) == want
    with pytest.deprecated_call(match=r"torch_r3.global_layout is deprecated; use torch_r3.global_geometry"):
        assert torch_r3.global_layout is global_geometry
    with pytest.deprecated_call(match=r"torch_r3.BatchLayout is deprecated; use torch_r3.BatchGeometry"):
        assert torch_r3.BatchLayout is torch_r3.BatchGeometry
    layout = importlib.import_module("torch_r3.layout")  # importing the old module is silent; reading warns
    with pytest.deprecated_call(match=r"torch_r3.layout.global_layout is deprecated"):
        assert layout.global_layout is global_geometry
    with pytest.raises(AttributeError):
        layout.nothing_here  # noqa: B018


def test_padding_rows_takes_the_old_name():
    want = padding_rows([0, 1], 1, 2, filler="balanced", num_experts=3)
    with pytest.deprecated_call(match=r"padding_rows\(padding=\)"):
        np.testing.assert_array_equal(padding_rows([0, 1], 1, 2, padding="balanced", num_experts=3), want)


def test_the_native_protocol_module_keeps_its_old_name():
    from torch_r3.protocols import native

    old = importlib.import_module("torch_r3.protocols.torch_r3")
    with pytest.deprecated_call(match=r"torch_r3.protocols.torch_r3.GENERATE_PATH is deprecated"):
        assert old.GENERATE_PATH == native.GENERATE_PATH
