"""SkyRL's `/skyrl/v1/generate`: answers built by SkyRL 0.4.0's own wire helpers, served on 127.0.0.1.

`fixtures/skyrl_generate.json` was written by `fixtures/make_skyrl_fixtures.py` with
SkyRL's `pack_routed_experts` and `build_logprobs_content`, serialised by orjson as
its server does, next to the routes fed in.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests import http_stub
from torch_r3 import RoutedExpertTrace
from torch_r3.errors import RemoteGenerateError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "skyrl_generate.json").read_text())


def ask(answer, call, **client_kwargs):
    return http_stub.ask("skyrl", "/skyrl/v1/generate", [answer], call, **client_kwargs)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["name"])
def test_skyrl_envelopes_decode_bit_for_bit(case):
    async def call(client):
        return await client.generate(
            case["prompt"],
            {"max_tokens": 4, "temperature": 1.0},
            return_routed_experts=True,
            routed_experts_prompt_start=case["start"],
            cache_salt="v3",
            model="policy-lora",
        )

    kwargs = {"num_layers": FIXTURE["num_layers"], "topk": FIXTURE["topk"], "num_experts": case["num_experts"]}
    result, (body,) = ask(case["response"], call, moe_layers=[1, 2], **kwargs)
    want = np.array(case["expected"]["routes"])
    np.testing.assert_array_equal(result.routed_experts.astype(np.int64), want)
    assert result.routed_experts.dtype == np.dtype(case["response"]["choices"][0]["routed_experts"]["dtype"])
    assert result.response_ids == tuple(case["expected"]["token_ids"])
    assert result.response_logprobs == tuple(case["expected"]["logprobs"])
    assert body["token_ids"] == case["prompt"] and body["cache_salt"] == "v3" and body["model"] == "policy-lora"
    assert body["sampling_params"].get("routed_experts_prompt_start", 0) == case["start"]
    assert body["sampling_params"]["logprobs"] == 1
    trace = RoutedExpertTrace()
    if case["start"] == 0:
        trace.record_result(result, prompt_len=len(case["prompt"]), prompt_ids=case["prompt"])
        assert trace.prompt_start == want.shape[0]


def test_null_routes_name_skyrls_and_vllms_switches():
    answer = json.loads(json.dumps(FIXTURE["cases"][0]["response"]))
    answer["choices"][0]["routed_experts"] = None

    async def call(client):
        return await client.generate([11, 12, 13, 14, 15], {}, return_routed_experts=True)

    with pytest.raises(RemoteGenerateError, match=r"enable_return_routed_experts.*moe_enable_routing_replay"):
        ask(answer, call)
