"""The old keywords, as 0.2.0's CHANGELOG promised them: each one a function really had warns (on the
user's line) and means what it meant; one it never had is a `TypeError`; one passed at its old
default value warns and changes nothing (issue 43.7, 43.8); a layout value is bounded where it is
built (43.9)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import torch_r3
from torch_r3 import Packed, Padded, R3Collator, ShardCollator, collate_routes
from torch_r3.health import RouteHealthCheck, RouteHealthWarning, check_route_health
from torch_r3.integrations import skyrl
from torch_r3.integrations.skyrl import controller
from torch_r3.integrations.verl import agent_loop, engine

ROUTES = [np.arange(12, dtype=np.uint8).reshape(2, 3, 2) % 5, np.ones((1, 3, 2), np.uint8)]
SAMPLES = [{"input_ids": [1, 2, 3], "routes": ROUTES[0]}, {"input_ids": [4], "routes": ROUTES[1]}]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- 43.7: a keyword the function never had is a TypeError, whatever it means elsewhere --------------

NEVER_HAD = [
    ("microbatch", lambda **kw: skyrl.microbatch({}, **kw), {"padding_side": "left"}),
    ("microbatch", lambda **kw: skyrl.microbatch({}, **kw), {"seq_len": 8}),
    ("microbatch", lambda **kw: skyrl.microbatch({}, **kw), {"workers": 2}),
    (
        "nested_routed_experts",
        lambda **kw: agent_loop.nested_routed_experts(ROUTES, [3, 2], **kw),
        {"pad_to_multiple_of": 8},
    ),
    (
        "nested_routed_experts",
        lambda **kw: agent_loop.nested_routed_experts(ROUTES, [3, 2], **kw),
        {"padding_side": "right"},
    ),
    (
        "collate_rollout_expert_indices",
        lambda **kw: controller.collate_rollout_expert_indices(ROUTES, np.array([3, 2]), **kw),
        {"pad_to_multiple_of": 8},
    ),
    (
        "collate_rollout_expert_indices",
        lambda **kw: controller.collate_rollout_expert_indices(ROUTES, np.array([3, 2]), **kw),
        {"seq_len": 8},
    ),
    ("install", lambda **kw: skyrl.install(**kw), {"pad_to_multiple_of": 8}),
    ("microbatch", lambda **kw: engine.microbatch(None, None, **kw), {"padding_side": "left"}),
    ("microbatch", lambda **kw: engine.microbatch(None, None, **kw), {"seq_len": 8}),
    (
        "padded_routed_experts",
        lambda **kw: agent_loop.padded_routed_experts(
            ROUTES, [1, 1], [2, 1], layout=torch_r3.PromptResponse(2, 3), **kw
        ),
        {"padding_side": "left"},
    ),
    ("collate_routes", lambda **kw: collate_routes(ROUTES, [3, 2], **kw), {"prompt_length_key": "p"}),
]


@pytest.mark.parametrize(("where", "call", "kwargs"), NEVER_HAD, ids=lambda v: v if isinstance(v, str) else None)
def test_a_keyword_the_function_never_had_is_a_type_error_naming_it(where, call, kwargs):
    """Defect: accepted, warned about as "same meaning", and ignored (the batch stayed as it was)."""
    (name,) = kwargs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no "same meaning" warning before it
        with pytest.raises(TypeError, match=rf"^{where} got an unexpected keyword argument '{name}'$"):
            call(**kwargs)


# -- 43.8: an old keyword at its old default value warns and changes nothing -------------------------

AT_DEFAULT = [
    ({"layout": "packed", "padding_side": "left"}, {"layout": "packed"}, "padding_side"),
    ({"layout": "padded", "prompt_width": None}, {"layout": "padded"}, "prompt_width"),
    ({"layout": "packed", "seq_len": None}, {"layout": "packed"}, "seq_len"),
    ({"prompt_length_key": "prompt_length"}, {}, "prompt_length_key"),
    (
        {"layout": torch_r3.Padded(side="right"), "padding_side": "left"},
        {"layout": Padded(side="right")},
        "padding_side",
    ),
    ({"memory": torch_r3.Memory(workers=1), "workers": None}, {"memory": torch_r3.Memory(workers=1)}, "workers"),
]


@pytest.mark.parametrize(("old", "new", "keyword"), AT_DEFAULT)
def test_an_old_keyword_at_its_old_default_value_warns_on_the_users_line_and_changes_nothing(old, new, keyword):
    """Defect: refused (ValueError/TypeError) where 0.2.0's CHANGELOG promised a DeprecationWarning."""
    want = R3Collator(**new, pad_token_id=0)(SAMPLES)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = R3Collator(**old, pad_token_id=0)(SAMPLES)
    assert [w.category for w in seen] == [DeprecationWarning], [str(w.message) for w in seen]
    assert str(seen[0].message).startswith(f"R3Collator({keyword}=") and "old default" in str(seen[0].message)
    assert seen[0].filename == __file__
    _same(got, want)


def test_the_same_keyword_off_its_default_is_still_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match=r"padding_side= applies to torch_r3.Padded only, got layout='packed'"):
        R3Collator(layout="packed", padding_side="right", pad_token_id=0)
    with pytest.raises(ValueError, match=r"prompt_length_key= applies to torch_r3.PromptResponse only"):
        R3Collator(prompt_length_key="p", pad_token_id=0)


# -- every old spelling warns on the user's line ----------------------------------------------------

OLD_SPELLINGS = [
    (lambda: collate_routes(ROUTES, [3, 2], padding="arange"), "collate_routes(padding=)"),
    (lambda: collate_routes(ROUTES, [3, 2], layers=[0]), "collate_routes(layers=)"),
    (lambda: collate_routes(ROUTES, [3, 2], padding_side="right"), "collate_routes(padding_side=)"),
    (lambda: collate_routes(ROUTES, [3, 2], workers=1), "collate_routes(workers=)"),
    (lambda: R3Collator(seq_len=4, pad_token_id=0), "R3Collator(seq_len=)"),
    (lambda: R3Collator(cache_bytes=0, pad_token_id=0), "R3Collator(cache_bytes=)"),
    (lambda: R3Collator(layers=[0], pad_token_id=0), "R3Collator(layers=)"),
    (lambda: ShardCollator(lambda i: SAMPLES, [[0, 1]], seq_len=4, pad_token_id=0), "ShardCollator(seq_len=)"),
    (lambda: ShardCollator(lambda i: SAMPLES, [[0, 1]], padding="arange", pad_token_id=0), "ShardCollator(padding=)"),
    (lambda: torch_r3.global_geometry([3], [np.uint8], pad_to_multiple_of=4), "global_geometry(pad_to_multiple_of=)"),
    (lambda: torch_r3.global_geometry([3], [np.uint8], padding="arange"), "global_geometry(padding=)"),
    (lambda: agent_loop.nested_routed_experts(ROUTES, [3, 2], workers=1), "nested_routed_experts(workers=)"),
    (
        lambda: agent_loop.padded_routed_experts(ROUTES, [1, 1], [2, 1], prompt_width=2, response_width=3),
        "padded_routed_experts(prompt_width=)",
    ),
    (lambda: torch_r3.BufferPool(max_cached_bytes=0), "BufferPool(max_cached_bytes=)"),
    (lambda: torch_r3.BufferPool().max_cached_bytes, "BufferPool.max_cached_bytes"),
    (lambda: torch_r3.global_layout, "torch_r3.global_layout"),
    (lambda: torch_r3.BatchLayout, "torch_r3.BatchLayout"),
    (lambda: torch_r3.collate.layout.padded_length, "torch_r3.collate.layout.padded_length"),
    (lambda: _protocols_torch_r3().GENERATE_PATH, "torch_r3.rollout.protocols.torch_r3.GENERATE_PATH"),
]


def _protocols_torch_r3():
    import importlib

    return importlib.import_module("torch_r3.rollout.protocols.torch_r3")


@pytest.mark.parametrize(("call", "named"), OLD_SPELLINGS, ids=[n for _, n in OLD_SPELLINGS])
def test_every_old_spelling_warns_on_the_users_line(call, named):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    ours = [w for w in seen if issubclass(w.category, DeprecationWarning) and str(w.message).startswith(named)]
    assert ours, [str(w.message) for w in seen]
    assert all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]


def test_skyrl_microbatch_packed_and_pad_to_multiple_of_keep_their_meaning():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="missing 'sequences'"):
            skyrl.microbatch({}, packed=True, pad_to_multiple_of=4)
    assert sorted(str(w.message).split(")")[0] for w in seen) == [
        "microbatch(packed=",
        "microbatch(pad_to_multiple_of=",
    ]
    assert all(w.filename == __file__ for w in seen)


# -- 43.9: a layout value is bounded where it is built -----------------------------------------------


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Packed(pad_to_multiple_of=10**30), "Packed.pad_to_multiple_of"),
        (lambda: Packed(pad_to_multiple_of=2**31), "Packed.pad_to_multiple_of"),
        (lambda: Padded(pad_to_multiple_of=10**30), "Padded.pad_to_multiple_of"),
        (lambda: Padded(seq_len=2**63), "Padded.seq_len"),
        (lambda: torch_r3.PromptResponse(10**30, 1), "PromptResponse.prompt_width"),
        (lambda: torch_r3.PromptResponse(1, 2**63), "PromptResponse.response_width"),
    ],
)
def test_a_length_too_large_for_the_batch_offsets_is_refused_where_it_is_built(build, field):
    """Defect: `Packed(pad_to_multiple_of=10**30)` was accepted, and collation failed in NumPy with a bare
    OverflowError naming nothing."""
    with pytest.raises(ValueError, match=rf"^{field} must be <= \d+"):
        build()


def test_the_largest_bounded_values_are_accepted():
    assert Packed(pad_to_multiple_of=2**31 - 1).pad_to_multiple_of == 2**31 - 1
    assert Padded(seq_len=2**63 - 1).seq_len == 2**63 - 1


# -- the one warning path: the package's user warnings point at the user's line too ------------------


def _constant_routes() -> np.ndarray:
    routes = np.tile(np.array([[3, 5]], np.uint8), (64, 2, 1))
    routes[:, 1] = np.random.default_rng(1).integers(0, 4, (64, 1)) * 2 + [0, 1]  # layer 1 varies
    return routes


@pytest.mark.parametrize(
    "call",
    [
        lambda: check_route_health(_constant_routes(), on_unhealthy="warn"),
        lambda: RouteHealthCheck("warn").check(_constant_routes(), trajectory="t"),
    ],
    ids=["check_route_health", "RouteHealthCheck.check"],
)
def test_a_health_warning_points_at_the_users_line(call):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    ours = [w for w in seen if issubclass(w.category, RouteHealthWarning)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, str(w.message)[:60]) for w in seen]


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins for real where an accelerator exists")
def test_the_pin_memory_warning_points_at_the_users_line():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        collate_routes(ROUTES, [3, 2], memory=torch_r3.Memory(pin_memory=True))
    ours = [w for w in seen if "no accelerator" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, str(w.message)) for w in seen]
