"""The argument checks: one rule per kind, and the same mistake read the same at every public site.

The first half specifies each kind's rule on `torch_r3._checks` itself. The
second half makes the same four mistakes (a NumPy integer, a bool, a float, a
negative size) at every public integer argument of the collation, layout,
shard, route, codec, trace, client, transport and testing modules, and checks
that each site answers them alike: the NumPy integer is accepted and gives the
result the Python `int` gives, the bool and the float are `TypeError`, the
negative size is `ValueError`, and every message names the argument.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import io
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from torch_r3 import (
    BufferPool,
    Memory,
    Padded,
    R3Collator,
    check_expert_ids,
    collate_routes,
    compact_routes,
    global_geometry,
    plan_microbatches,
)
from torch_r3._checks import (
    check_at_least,
    check_bool,
    check_choice,
    check_dtype,
    check_finite_float,
    check_int,
    check_integer_dtype,
    check_non_negative,
    check_positive,
    check_str,
)
from torch_r3.collate.geometry import padded_length
from torch_r3.collate.shard import ShardCollator
from torch_r3.cpu import pool_workers
from torch_r3.replay.checks import first_bad_route
from torch_r3.rollout.codec import decode_routes, decode_sglang_routes, decode_vllm_routes, encode_routes
from torch_r3.rollout.trace import RoutedExpertTrace, TokenMetadataTrace
from torch_r3.routes import canonical_dtype_for

NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
CANONICAL = (np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.int32))


# -- each kind's rule ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_an_integer_is_any_python_or_numpy_integer_returned_as_a_python_int(kind):
    got = check_int(kind(7), "n")
    assert got == 7 and type(got) is int
    assert type(check_int(2**70, "n")) is int  # no bound of its own: sizes bound themselves


@pytest.mark.parametrize(
    "value, shown",
    [
        (True, "bool"),
        (np.bool_(False), "bool"),
        (2.0, "float"),
        (np.float64(2), "float64"),
        ("2", "str"),
        (None, "NoneType"),
    ],
)
def test_a_bool_a_float_a_string_or_none_is_not_an_integer(value, shown):
    with pytest.raises(TypeError) as info:
        check_int(value, "num_layers")
    assert str(info.value) == f"num_layers must be an int, got {shown}"


def test_sizes_have_one_wording_per_bound():
    assert check_positive(np.uint8(1), "topk") == 1
    assert check_non_negative(0, "retries") == 0
    assert check_at_least(5, "x", 5) == 5
    for check, value, words in [
        (check_positive, 0, "topk must be >= 1, got 0"),
        (check_positive, -1, "topk must be >= 1, got -1"),
        (check_non_negative, np.int64(-1), "topk must be >= 0, got -1"),
    ]:
        with pytest.raises(ValueError) as info:
            check(value, "topk")
        assert str(info.value) == words
    with pytest.raises(ValueError, match="x must be >= 5, got 4"):
        check_at_least(4, "x", 5)
    # The type is checked before the value: a negative float is a wrong type, not a bad value.
    with pytest.raises(TypeError, match="topk must be an int, got float"):
        check_positive(-1.0, "topk")


def test_a_flag_is_python_or_numpy_true_or_false_and_nothing_else():
    assert check_bool(np.True_, "compact") is True and check_bool(False, "compact") is False
    for value in (1, 0, "yes", None, np.int64(1)):
        with pytest.raises(TypeError) as info:
            check_bool(value, "compact")
        assert str(info.value) == f"compact must be True or False, got {value!r}"


def test_a_finite_float_refuses_bools_and_non_numbers_by_type_and_infinities_by_value():
    assert check_finite_float(np.float32(0.25), "backoff") == 0.25
    assert type(check_finite_float(np.int64(3), "backoff")) is float
    assert check_finite_float(0, "backoff") == 0.0
    for value in (True, "1", None):
        with pytest.raises(TypeError, match="backoff must be a number, got"):
            check_finite_float(value, "backoff")
    for value in (math.inf, -math.inf, math.nan, -0.5):
        with pytest.raises(ValueError, match=r"backoff must be a finite number >= 0, got"):
            check_finite_float(value, "backoff")
    with pytest.raises(ValueError) as info:
        check_finite_float(0.0, "timeout", allow_zero=False, note="None for no limit")
    assert str(info.value) == "timeout must be a finite number > 0, got 0.0 (None for no limit)"


def test_a_choice_is_one_member_of_its_enum_compared_by_type():
    assert check_choice("packed", "layout", ("padded", "packed")) == "packed"
    assert check_choice(np.str_("packed"), "layout", ("padded", "packed")) == "packed"
    with pytest.raises(ValueError) as info:
        check_choice("ragged", "layout", ("padded", "packed"))
    assert str(info.value) == "layout must be one of ['padded', 'packed'], got 'ragged'"
    # True == 1, but a bool is not the member 1; an array's == would be elementwise.
    for value in (True, np.array(["padded", "packed"]), None):
        with pytest.raises(ValueError, match="layout must be one of"):
            check_choice(value, "layout", ("padded", "packed"))
    with pytest.raises(ValueError, match="n must be one of"):
        check_choice(True, "n", (1, 2))


@pytest.mark.parametrize(
    "value, want", [(np.uint8, np.uint8), ("int16", np.int16), (torch.int32, np.int32), (np.dtype("=i2"), np.int16)]
)
def test_a_dtype_is_named_by_numpy_torch_or_a_string(value, want):
    assert check_dtype(value, "dtype", CANONICAL) == np.dtype(want)


@pytest.mark.parametrize(
    "value, error, words",
    [
        (torch.float32, ValueError, "dtype must be uint8, int16 or int32, got torch.float32"),
        (np.int64, ValueError, "dtype must be uint8, int16 or int32 (native byte order), got <i8 (int64)"),
        (">i2", ValueError, r"dtype must be uint8, int16 or int32 (native byte order), got >i2 (>i2)"),
        ("bogus", TypeError, "dtype must be a NumPy or torch dtype (uint8, int16 or int32), got 'bogus'"),
    ],
)
def test_a_dtype_outside_the_allowed_ones_is_a_value_error_and_a_non_dtype_a_type_error(value, error, words):
    with pytest.raises(error) as info:
        check_dtype(value, "dtype", CANONICAL)
    assert str(info.value) == words


def test_an_array_of_a_non_integer_dtype_is_a_type_error():
    check_integer_dtype(np.zeros(2, np.uint64), "routes")
    for dtype in (np.float32, bool, np.complex64):
        with pytest.raises(TypeError, match=r"routes: expected an integer dtype, got"):
            check_integer_dtype(np.zeros(2, dtype), "routes")


def test_a_string_argument_refuses_bytes():
    assert check_str("m", "model") == "m"
    with pytest.raises(TypeError, match="model must be a str, got bytes"):
        check_str(b"m", "model")


# -- the same mistake at every public site -------------------------------------------------

GOOD = np.array([[[0, 1]]], np.uint8)  # one route row: a trajectory of 2 tokens, 1 layer, top-2


def _npy_text(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _raw_text(array: np.ndarray) -> str:
    """SGLang's form: base64 of the raw int32 ids."""
    return base64.b64encode(array.astype(np.int32).tobytes()).decode()


def _client_moe_layers(moe_layers: list[Any]) -> Any:
    from torch_r3.rollout.client import RemoteGenerateClient

    layers = RemoteGenerateClient("http://127.0.0.1:9", num_layers=4, topk=2, moe_layers=moe_layers).moe_layers
    assert all(type(layer) is int for layer in layers)
    return layers


def _client(**kwargs: Any) -> Any:
    from torch_r3.rollout.client import RemoteGenerateClient

    return repr(RemoteGenerateClient("http://127.0.0.1:9", **kwargs).limits)


def _client_config(**kwargs: Any) -> Any:
    from torch_r3.rollout.client import RemoteGenerateClient, TransportConfig

    return repr(RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(**kwargs)).transport_config)


def _transport(**kwargs: Any) -> Any:
    from torch_r3.rollout.client import TransportConfig

    return repr(TransportConfig(**kwargs))


def _trace_record(trace: RoutedExpertTrace | None = None, **kwargs: Any) -> Any:
    trace = trace if trace is not None else RoutedExpertTrace()
    trace.record(**{"prompt_len": 2, "generated_len": 1, "routes": np.array([[[0, 1]], [[1, 0]]], np.uint8), **kwargs})
    return trace.finalize(token_count=3).tolist()


def _testing(kind: str, **kwargs: Any) -> Any:
    # The public front of torch_r3.testing only: its machinery (the prefix cache, the wire
    # protocols) is private since the public surface was trimmed, and checked through the server.
    from torch_r3 import testing

    if kind == "model":
        model = testing.TinyMoELM(**kwargs)
        return repr((model.vocab_size, model.num_layers, model.num_experts, model.topk, model.first_k_dense))
    if kind == "server":  # built, never started: the arguments are checked before any socket
        server = testing.LoopbackServer(**kwargs)
        cache = server.engine.cache
        blocks = None if cache is None else (cache.block_size, cache.max_blocks)
        return repr((server.port, server.wire.routes_enabled, blocks))
    faults = testing.Faults()
    faults.disconnect(**kwargs)
    return faults.pending


def _output(out: Any) -> Any:
    """A comparable form of a site's result."""
    if isinstance(out, dict):
        return {k: _output(v) for k, v in out.items()}
    if isinstance(out, (torch.Tensor, np.ndarray)):
        return (str(out.dtype), out.tolist())
    if isinstance(out, (list, tuple)):
        return [_output(v) for v in out]
    return repr(out)


# (argument, a valid value, the call) for every public integer argument of these modules.
SIZES: list[tuple[str, int, Callable[[Any], Any]]] = [
    ("pad_to_multiple_of", 4, lambda v: collate_routes([GOOD], [2], layout=Padded(pad_to_multiple_of=v))),
    ("seq_len", 4, lambda v: collate_routes([GOOD], [2], layout=Padded(seq_len=v))),
    ("max_output_bytes", 10**6, lambda v: collate_routes([GOOD], [2], memory=Memory(max_output_bytes=v))),
    (
        "num_experts",
        4,
        lambda v: collate_routes([GOOD], [2], filler="balanced", num_experts=v, layout=Padded(seq_len=4)),
    ),
    (
        "pad_to_multiple_of",
        4,
        lambda v: R3Collator(layout=Padded(pad_to_multiple_of=v), pad_token_id=0)(
            [{"input_ids": [1, 2], "routes": GOOD}]
        ),
    ),
    ("cache_bytes", 0, lambda v: R3Collator(memory=Memory(cache_bytes=v), pad_token_id=0).buffers.cache_bytes),
    ("pad_to_multiple_of", 4, lambda v: global_geometry([3], [np.uint8], layout=Padded(pad_to_multiple_of=v))),
    ("num_experts", 300, lambda v: global_geometry([3], [np.uint8], filler="balanced", num_experts=v)),
    ("pad_to_multiple_of", 4, lambda v: padded_length([3, 5], pad_to_multiple_of=v)),
    ("dp_size", 2, lambda v: plan_microbatches([3, 4], dp_size=v)),
    ("micro_batch_size", 1, lambda v: plan_microbatches([3, 4], dp_size=1, micro_batch_size=v)),
    ("max_tokens_per_microbatch", 8, lambda v: plan_microbatches([3, 4], dp_size=1, max_tokens_per_microbatch=v)),
    (
        "seq_len",
        4,
        lambda v: next(
            iter(
                ShardCollator(
                    lambda i: [{"input_ids": [1, 2], "routes": GOOD}], [[0]], layout=Padded(seq_len=v), pad_token_id=0
                )
            )
        ),
    ),
    ("max_id", 255, canonical_dtype_for),
    ("num_experts", 2, lambda v: compact_routes(GOOD, num_experts=v)),
    ("num_experts", 2, lambda v: check_expert_ids(GOOD, v)),
    ("num_experts", 2, lambda v: decode_routes(encode_routes(GOOD), num_experts=v)),
    ("max_bytes", 64, lambda v: decode_routes(encode_routes(GOOD), max_bytes=v)),
    ("num_layers", 1, lambda v: decode_routes(encode_routes(GOOD), num_layers=v, topk=2)),
    ("topk", 2, lambda v: decode_routes(encode_routes(GOOD), num_layers=1, topk=v)),
    ("num_layers", 1, lambda v: decode_sglang_routes(_raw_text(GOOD), num_layers=v, topk=2)),
    ("num_tokens", 1, lambda v: decode_sglang_routes(_raw_text(GOOD), num_layers=1, topk=2, num_tokens=v)),
    ("topk", 2, lambda v: decode_vllm_routes(_npy_text(GOOD), num_layers=1, topk=v)),
    ("num_experts", 2, lambda v: decode_vllm_routes(_npy_text(GOOD), num_experts=v)),
    ("num_layers", 1, lambda v: RoutedExpertTrace(num_layers=v, topk=2).finalize(token_count=1)),
    ("topk", 2, lambda v: RoutedExpertTrace(num_layers=1, topk=v).finalize(token_count=1)),
    ("num_experts", 8, lambda v: _trace_record(RoutedExpertTrace(num_experts=v))),
    ("prompt_len", 2, lambda v: _trace_record(prompt_len=v)),
    ("generated_len", 1, lambda v: _trace_record(generated_len=v)),
    ("token_count", 1, lambda v: RoutedExpertTrace(num_layers=1, topk=2).finalize(token_count=v)),
    ("row_shape[0]", 1, lambda v: TokenMetadataTrace(row_shape=(v, 2)).finalize()),
    ("expected_rows", 1, lambda v: TokenMetadataTrace().append(GOOD, expected_rows=v)),
    ("num_layers", 4, lambda v: _client(num_layers=v, topk=2)),
    ("topk", 2, lambda v: _client(num_layers=4, topk=v)),
    ("num_experts", 8, lambda v: _client(num_experts=v)),
    ("moe_layers[0]", 1, lambda v: _client_moe_layers([v])),
    ("retries", 2, lambda v: _client_config(retries=v)),
    ("max_concurrency", 3, lambda v: _client_config(max_concurrency=v)),
    ("max_response_bytes", 1024, lambda v: _client_config(max_response_bytes=v)),
    ("retries", 2, lambda v: _transport(retries=v)),
    ("max_concurrency", 3, lambda v: _transport(max_concurrency=v)),
    ("max_response_bytes", 1024, lambda v: _transport(max_response_bytes=v)),
    ("num_layers", 3, lambda v: _testing("model", num_layers=v)),
    ("topk", 2, lambda v: _testing("model", topk=v)),
    ("vocab_size", 16, lambda v: _testing("model", vocab_size=v)),
    ("first_k_dense", 1, lambda v: _testing("model", first_k_dense=v)),
    ("n", 2, lambda v: _testing("faults", n=v)),
    ("block_size", 2, lambda v: _testing("server", block_size=v)),
    ("cache_blocks", 8, lambda v: _testing("server", cache_blocks=v)),
    ("port", 0, lambda v: _testing("server", port=v)),
    ("workers", 2, lambda v: collate_routes([GOOD], [2], memory=Memory(workers=v))),
    (
        "workers",
        2,
        lambda v: R3Collator(memory=Memory(workers=v), pad_token_id=0)([{"input_ids": [1, 2], "routes": GOOD}]),
    ),
    ("cache_bytes", 0, lambda v: BufferPool(cache_bytes=v).cache_bytes),
    ("shape[1]", 3, lambda v: BufferPool().empty((2, v), torch.uint8)),
    ("cap", 2, lambda v: pool_workers(cap=v, usable=8.0)),
    ("reserve", 1, lambda v: pool_workers(reserve=v, usable=8.0)),
    ("share", 2, lambda v: pool_workers(share=v, usable=8.0)),
    ("cp_size", 2, lambda v: _megatron().RankSlice(cp_size=v)),
    ("tp_size", 2, lambda v: _megatron().RankSlice(tp_size=v, sequence_parallel=True)),
    ("cp_rank", 1, lambda v: _megatron().RankSlice(cp_size=2, cp_rank=v)),
    ("tp_rank", 1, lambda v: _megatron().RankSlice(tp_size=2, tp_rank=v)),
    ("moe_layer_freq", 2, lambda v: _megatron().moe_layer_pattern(SimpleNamespace(num_layers=4, moe_layer_freq=v))),
    ("num_sequences", 4, lambda v: _bench_config(num_sequences=v)),
    ("warmup", 2, lambda v: _bench_config(warmup=v)),
    ("workers", 2, lambda v: _bench_config(workers=v)),
    ("num_experts", 8, lambda v: _bench_config(num_experts=v)),
    ("seed", 3, lambda v: _bench_config(seed=v)),
]


def _megatron() -> Any:
    """`torch_r3.megatron.slicing`, or a skip where megatron-core is not installed."""
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    from torch_r3.megatron import slicing

    return slicing


def _bench_config(**kwargs: Any) -> Any:
    from torch_r3.bench.config import BenchConfig

    return BenchConfig(**kwargs)


SIZE_IDS = [f"{i}-{name}" for i, (name, _, _) in enumerate(SIZES)]


@pytest.mark.parametrize(("name", "valid", "call"), SIZES, ids=SIZE_IDS)
def test_a_numpy_integer_is_accepted_wherever_a_python_int_is(name, valid, call):
    assert _output(call(np.int64(valid))) == _output(call(valid))
    assert _output(call(np.uint32(valid))) == _output(call(valid))


@pytest.mark.parametrize(("name", "valid", "call"), SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize(
    "mistake", [True, np.True_, float, np.float64], ids=["bool", "np.bool_", "float", "np.float64"]
)
def test_a_bool_or_a_float_for_an_integer_is_a_type_error_naming_the_argument(name, valid, call, mistake):
    value = mistake(valid) if mistake in (float, np.float64) else mistake
    with pytest.raises(TypeError) as info:
        call(value)
    assert f"{name} must be an int, got" in str(info.value)


@pytest.mark.parametrize(("name", "valid", "call"), SIZES, ids=SIZE_IDS)
def test_a_negative_size_is_a_value_error_naming_the_argument(name, valid, call):
    with pytest.raises(ValueError) as info:
        call(-1)
    assert name in str(info.value) and "-1" in str(info.value)


def test_a_zero_block_size_is_refused_not_replaced_by_the_default():
    # LoopbackServer(block_size=0) used to serve with the protocol's default block size.
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        _testing("server", block_size=0)


def _generate(**kwargs: Any) -> Any:
    from torch_r3.rollout.client import RemoteGenerateClient, TransportConfig

    async def main() -> None:
        async with RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(retries=0)) as client:
            await client.generate([1, 2], **kwargs)

    return asyncio.run(main())


# (argument, the call) for every public flag of these modules; each call stops before any I/O.
FLAGS: list[tuple[str, Callable[[Any], Any]]] = [
    ("compact", lambda v: collate_routes([GOOD], [2], compact=v)),
    ("compact", lambda v: R3Collator(compact=v, pad_token_id=0)),
    ("prefetch", lambda v: ShardCollator(lambda i: [], [[0]], prefetch=v, pad_token_id=0)),
    ("allow_mixed_versions", lambda v: RoutedExpertTrace(allow_mixed_versions=v)),
    ("routes_enabled", lambda v: _testing("server", routes_enabled=v)),
    ("sglang_ignores_start", lambda v: _testing("server", protocol="sglang", sglang_ignores_start=v)),
    ("prefix_cache", lambda v: _testing("server", prefix_cache=v)),
]


@pytest.mark.parametrize(("name", "call"), FLAGS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(FLAGS)])
def test_a_flag_takes_numpy_bools_and_refuses_ints_and_strings_with_one_wording(name, call):
    call(np.True_)
    call(np.False_)
    for value in (1, "yes", None):
        with pytest.raises(TypeError) as info:
            call(value)
        assert str(info.value) == f"{name} must be True or False, got {value!r}"


def test_return_routed_experts_takes_a_numpy_bool_and_refuses_an_int():
    # The one flag whose wording a test pins ("must be a bool"); its rule is the others'.
    with pytest.raises(Exception) as info:  # a NumPy bool passes the check; the call then finds no server
        _generate(return_routed_experts=np.False_)
    assert not isinstance(info.value, TypeError)
    with pytest.raises(TypeError, match="return_routed_experts must be a bool, got int"):
        _generate(return_routed_experts=1)


@pytest.mark.parametrize(
    "value, error", [(np.float32(0.5), None), (True, TypeError), ("1", TypeError), (math.inf, ValueError)]
)
@pytest.mark.parametrize("name", ["backoff", "max_backoff", "timeout", "connect_timeout"])
def test_seconds_follow_the_finite_float_rule_in_the_client_and_its_config(name, value, error):
    from torch_r3.rollout.client import RemoteGenerateClient, TransportConfig

    def client_config(**kw: Any) -> TransportConfig:
        return RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(**kw)).transport_config

    for build in (TransportConfig, client_config):
        if error is None:
            assert getattr(build(**{name: value}), name) == 0.5
            assert type(getattr(build(**{name: value}), name)) is float
        else:
            with pytest.raises(error, match=name):
                build(**{name: value})


@pytest.mark.parametrize(
    "call, words",
    [
        (
            lambda: collate_routes([GOOD], [2], layout="ragged"),
            "layout must be one of ['padded', 'packed'], got 'ragged'",
        ),
        (
            lambda: collate_routes([GOOD], [2], filler="bogus"),
            "filler must be one of ['arange', 'balanced', 'zeros'], got 'bogus'",
        ),
        (
            lambda: _client(server="tgi"),
            "server must be one of ['torch_r3', 'sglang', 'vllm', 'vllm-openai', 'sglang-openai', 'megatron', 'skyrl'], got 'tgi'",
        ),
    ],
)
def test_an_enum_names_its_members_the_same_way_at_every_site(call, words):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == words


def test_a_route_dtype_argument_follows_the_dtype_rule_in_collation_and_layout():
    for call in (
        lambda d: collate_routes([GOOD], [2], dtype=d),
        lambda d: global_geometry([2], [d]),
        lambda d: R3Collator(dtype=d, pad_token_id=0),
    ):
        with pytest.raises(ValueError, match=r"must be uint8, int16 or int32, got torch.float32"):
            call(torch.float32)
        with pytest.raises(TypeError, match=r"must be a NumPy or torch dtype"):
            call("bogus")


def test_both_hooks_find_the_same_bad_route_with_one_framework_free_check():
    """The id range and duplicate rule has one home, shared by the Megatron and transformers hooks."""
    import subprocess
    import sys

    from torch_r3.replay.checks import first_bad_route

    # A reference: scan every checked route in batch order in plain Python.
    rng = np.random.default_rng(0)
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        routes = torch.from_numpy(rng.integers(0, 6, size=(3, 4, 2, 2)).astype(np.int64)).to(dtype)
        checked = torch.from_numpy(rng.random((3, 4)) < 0.6)
        want = None
        for b in range(3):
            for t in range(4):
                for j in range(2):
                    r = routes[b, t, j].tolist()
                    if want is None and bool(checked[b, t]) and (len(set(r)) < 2 or max(r) >= 5):
                        want = (b, t, j, r)
        assert first_bad_route(routes, checked, 5) == want
    # The module imports no training framework: the transformers hook needs no megatron-core.
    code = "import sys, torch_r3.replay; assert not [m for m in ('megatron', 'transformers') if m in sys.modules]"
    subprocess.run([sys.executable, "-c", code], check=True)
    for hook_checks in ("torch_r3.megatron.batch_checks", "torch_r3.transformers.hook"):
        pytest.importorskip(hook_checks.rsplit(".", 1)[0])
        source = open(importlib.import_module(hook_checks).__file__, encoding="utf-8").read()
        assert "check_replayed_ids" in source and "_any_bad" not in source and ".sort(" not in source


@pytest.mark.parametrize("chunk", [1 << 18, 40, 8])
def test_the_whole_tensor_route_check_finds_what_a_python_scan_of_every_route_finds(monkeypatch, chunk):
    """Range and repeats in a few whole-tensor passes (issue 44): every K, dtype and chunk boundary, against a scan."""
    from torch_r3.replay import checks

    monkeypatch.setattr(checks, "CHUNK_IDS", chunk)
    monkeypatch.setattr(checks, "TAGGED_CHUNK_IDS", chunk)  # small chunks: repeats across a chunk boundary
    rng = np.random.default_rng(7)
    experts = 40
    for k in (1, 2, 3, 5, 8, 9):
        for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
            for m in (1, 3, 8, 13):
                for fault in ("none", "repeat", "range", "negative"):
                    routes = torch.from_numpy(np.stack([rng.permutation(experts)[:k] for _ in range(m)])).to(dtype)
                    i, j = int(rng.integers(0, m)), int(rng.integers(0, k))
                    if fault == "repeat" and k > 1:
                        routes[i, j] = routes[i, (j + int(rng.integers(1, k))) % k]
                    elif fault == "range":
                        routes[i, j] = 255 if dtype == torch.uint8 else experts + 1
                    elif fault == "negative" and dtype.is_signed:
                        routes[i, j] = -1
                    rows = routes.tolist()
                    bad = [b for b, r in enumerate(rows) if len(set(r)) < k or min(r) < 0 or max(r) >= experts]
                    want = None if not bad else (0, bad[0], 0, rows[bad[0]])
                    got = first_bad_route(routes.view(1, m, 1, k), torch.ones(1, m, dtype=torch.bool), experts)
                    assert got == want, (k, dtype, m, fault)


@pytest.mark.parametrize("chunk", [1 << 18, 48, 16])
@pytest.mark.parametrize(
    "dtype, experts",
    [(torch.uint8, 128), (torch.uint8, 200), (torch.uint8, 256), (torch.int16, 32767), (torch.int32, 1 << 20)],
)
def test_the_route_check_holds_at_the_top_of_the_id_range(monkeypatch, chunk, dtype, experts):
    """Ids near the dtype's top bit (which the check's fast path uses to tell neighbouring routes apart).

    Neighbouring routes share ids that differ only in the top bit, every fault sits
    at a route's edge (first or last id, first or last route), and an id one past
    the range sits next to a route holding the same low bits: the result is the
    first bad route of a plain scan, and a clean batch is clean.
    """
    from torch_r3.replay import checks

    monkeypatch.setattr(checks, "CHUNK_IDS", chunk)
    monkeypatch.setattr(checks, "TAGGED_CHUNK_IDS", chunk)
    rng = np.random.default_rng(11)
    k, m = 8, 13
    top = 1 << (torch.iinfo(dtype).bits - (2 if dtype.is_signed else 1))  # the highest bit below the sign
    for trial in range(24):
        base = rng.permutation(min(top, experts))[:k]
        rows = []
        for r in range(m):  # alternate routes: ids x and x + top (where the range has them), distinct per route
            ids = [int(x) for x in base]
            if r % 2 and experts > top:
                ids = [x + top if x + top < experts else x for x in ids]
            rows.append(ids)
        fault, r, j = trial % 4, int(rng.choice([0, m - 1, int(rng.integers(0, m))])), int(rng.choice([0, k - 1]))
        if fault == 1:  # a repeat at the route's edge
            rows[r][j] = rows[r][k - 1 - j]
        elif fault == 2:  # one past the range, next to a route with the same low bits
            rows[r][j] = experts if experts < torch.iinfo(dtype).max + 1 else rows[r][j]
        elif fault == 3 and dtype.is_signed:
            rows[r][j] = -1 - rows[r][j]
        routes = torch.tensor(rows, dtype=torch.int64).to(dtype)
        rows = routes.tolist()
        bad = [b for b, x in enumerate(rows) if len(set(x)) < k or min(x) < 0 or max(x) >= experts]
        want = None if not bad else (0, bad[0], 0, rows[bad[0]])
        got = first_bad_route(routes.view(1, m, 1, k), torch.ones(1, m, dtype=torch.bool), experts)
        assert got == want, (trial, rows)


@pytest.mark.parametrize("chunk", [1 << 18, 48, 16])
@pytest.mark.parametrize("dtype, experts", [(torch.uint8, 128), (torch.int16, 300), (torch.uint8, 256)])
def test_a_clean_batch_passes_the_whole_tensor_check_without_the_per_route_scan(monkeypatch, chunk, dtype, experts):
    """No clean batch takes the exact per-route path, whatever ids its last route holds, at any route count.

    The filler compared after the last route, the tags of odd routes and the chunk
    boundaries must never make a clean batch look bad (it would pay the per-route scan).
    """
    from torch_r3.replay import checks

    def scan(*args):
        raise AssertionError("a clean batch took the per-route scan")

    monkeypatch.setattr(checks, "CHUNK_IDS", chunk)
    monkeypatch.setattr(checks, "TAGGED_CHUNK_IDS", chunk)
    monkeypatch.setattr(checks, "bad_rows", scan)
    rng = np.random.default_rng(3)
    for k in (2, 3, 8):
        for m in (1, 2, 3, 4, 7, 8):
            for lane in range(k):  # id 0, the tag's own low bits, at every lane of every route
                rows = [rng.permutation(np.arange(1, experts))[: k - 1].tolist() for _ in range(m)]
                for row in rows:
                    row.insert(lane, 0)
                routes = torch.tensor(rows, dtype=torch.int64).to(dtype).view(1, m, 1, k)
                assert first_bad_route(routes, torch.ones(1, m, dtype=torch.bool), experts) is None, (k, m, lane)
