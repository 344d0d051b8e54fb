"""Megatron-core's inference server: answers its own 0.19.2 `/v1/completions` blueprint built, served on 127.0.0.1.

`fixtures/megatron_inference.json` was written by `fixtures/make_megatron_fixtures.py`,
which ran megatron-core 0.19.2's real Quart blueprint on finished
`DynamicInferenceRequest`s (serialised and sent through msgpack as its client
receives them), next to the routes fed in.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import http_stub
from torch_r3 import RoutedExpertTrace
from torch_r3.errors import RemoteGenerateError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "megatron_inference.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}


def ask(answer, call, **client_kwargs):
    return http_stub.ask("megatron", "/v1/completions", [answer], call, **client_kwargs)


def generate(case, start=0, **client_kwargs):
    async def call(client):
        return await client.generate(
            case["prompt"], {"max_tokens": 3}, return_routed_experts=True, routed_experts_prompt_start=start
        )

    kwargs = {"num_layers": FIXTURE["num_layers"], "topk": FIXTURE["topk"], "num_experts": case["num_experts"]}
    return ask(case["response"], call, **{**kwargs, **client_kwargs})


def test_the_fixture_comes_from_megatron_core_0192():
    assert FIXTURE["megatron_core"].startswith("0.19.2")
    assert CASES["one-epoch"]["response"]["choices"][0]["moe_topk_indices"][0] == "ndarray"  # its serialised array


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("start", [0, 4])
def test_routes_decode_bit_for_bit_and_the_start_is_applied_client_side(name, start):
    case = CASES[name]
    result, (body,) = generate(case, start)
    want = np.array(case["expected"]["routes"])[start:]
    np.testing.assert_array_equal(result.routed_experts.astype(np.int64), want)
    assert result.routed_experts.dtype == (np.uint8 if want.max() < 256 else np.int16)
    assert result.response_ids == tuple(case["expected"]["token_ids"])
    assert result.response_logprobs == (-0.5, -0.625, -0.75)
    assert body == {"prompt": case["prompt"], "max_tokens": 3, "logprobs": 1}  # no start field: the server has none
    assert "moe_topk_indices" not in result.raw["choices"][0]


def test_policy_epoch_is_the_weight_version_and_one_epoch_passes_the_trace():
    case = CASES["one-epoch"]
    result, _ = generate(case)
    assert result.weight_version == "4"
    assert [(s.version, s.start, s.end) for s in result.weight_versions] == [("4", 0, 3)]
    assert [(s.version, s.start, s.end) for s in result.route_versions] == [("4", 0, 7)]
    trace = RoutedExpertTrace()
    trace.record_result(result, prompt_len=5, prompt_ids=case["prompt"])
    assert trace.weight_versions == ("4",)


def test_a_kv_cache_epoch_trailing_the_policy_epoch_is_a_mixed_version_turn():
    case = CASES["kv-trails-policy"]
    result, _ = generate(case)
    assert result.weight_version == "5"
    assert [(s.version, s.start, s.end) for s in result.route_versions] == [("4", 0, 6), ("5", 6, 7)]
    with pytest.raises(ValueError, match=r"rows 0\.\.5.*weight update kept its older routes"):
        RoutedExpertTrace().record_result(result, prompt_len=5, prompt_ids=case["prompt"])
    RoutedExpertTrace(allow_mixed_versions=True).record_result(result, prompt_len=5, prompt_ids=case["prompt"])


def test_a_weight_update_mid_request_splits_the_tokens_spans():
    # Boundary [6, 5]: positions from 6 ran under epoch 5; token j was sampled from position 4 + j.
    result, _ = generate(CASES["update-mid-request"])
    assert [(s.version, s.start, s.end) for s in result.weight_versions] == [("4", 0, 2), ("5", 2, 3)]
    with pytest.raises(ValueError, match="more than one weight version"):
        RoutedExpertTrace().record_result(result, prompt_len=5)


def test_missing_routes_name_megatrons_switch_and_salts_are_refused():
    answer = json.loads(json.dumps(CASES["one-epoch"]["response"]))
    del answer["choices"][0]["moe_topk_indices"]

    async def call(client):
        return await client.generate([11, 12, 13, 14, 15], {"max_tokens": 3}, return_routed_experts=True)

    with pytest.raises(RemoteGenerateError, match="moe_enable_routing_replay"):
        ask(answer, call)

    async def salted(client):
        return await client.generate([1, 2], {}, cache_salt="v1")

    with pytest.raises(ValueError, match="no cache salt"):
        ask(answer, salted)


def test_plain_nested_lists_are_read_too_and_ragged_ones_refused():
    answer = json.loads(json.dumps(CASES["one-epoch"]["response"]))
    rows = CASES["one-epoch"]["expected"]["routes"]
    answer["choices"][0]["moe_topk_indices"] = rows
    result, _ = ask(answer, lambda c: c.generate([11, 12, 13, 14, 15], {}, return_routed_experts=True))
    np.testing.assert_array_equal(result.routed_experts, np.array(rows))
    answer["choices"][0]["moe_topk_indices"] = [*rows[:-1], [[1, 2]]]
    with pytest.raises(RemoteGenerateError, match="not a rectangular array"):
        ask(answer, lambda c: c.generate([11, 12, 13, 14, 15], {}, return_routed_experts=True))
