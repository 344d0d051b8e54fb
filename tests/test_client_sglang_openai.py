"""SGLang's OpenAI-compatible endpoints: answers built by sglang 0.5.23's own response builders, served on 127.0.0.1.

`fixtures/sglang_openai.json` was written by `fixtures/make_sglang_openai_fixtures.py`
with SGLang's `_build_completion_response` / `_build_chat_response` and its
detokenizer's base64, next to the routes each answer must decode to and the
request fields SGLang's request classes declare. The routes here are decoded
independently of torch_r3 (NumPy's `frombuffer` of the base64 text) as well.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from tests import http_stub
from torch_r3 import RoutedExpertTrace
from torch_r3.errors import RemoteGenerateError
from torch_r3.health.check import RouteHealthError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_openai.json").read_text())
SHAPE = {"num_layers": FIXTURE["num_layers"], "topk": FIXTURE["topk"]}
CANONICAL = {64: np.uint8, 512: np.int16, 70000: np.int32}


def ask(path, answers, call, **client_kwargs):
    return http_stub.ask("sglang-openai", path, answers, call, **{**SHAPE, **client_kwargs})


def test_the_fixture_comes_from_sglang_0523():
    assert FIXTURE["sglang"] == "0.5.23"


@pytest.mark.parametrize("case", FIXTURE["completions"], ids=lambda c: c["name"])
def test_completions_with_token_ids_decode_what_sglang_built(case):
    async def call(client):
        return await client.generate(
            case["prompt"],
            {"max_tokens": 4, "temperature": 1.0},
            return_routed_experts=True,
            routed_experts_prompt_start=case["start"],
            cache_salt="v7",
        )

    result, (body,) = ask(
        "/v1/completions", [case["response"]], call, num_experts=case["num_experts"], moe_layers=[1, 2]
    )
    want = case["expected"]
    assert result.response_ids == tuple(want["token_ids"])
    assert result.response_logprobs == tuple(want["logprobs"])
    # Bit for bit, against NumPy's own reading of SGLang's int32 text, and in the narrowest canonical dtype.
    raw = np.frombuffer(base64.b64decode(case["response"]["sglext"]["routed_experts"]), "<i4")
    np.testing.assert_array_equal(result.routed_experts.reshape(-1), raw)
    np.testing.assert_array_equal(result.routed_experts.astype(np.int64), np.array(want["routes"]))
    assert result.routed_experts.dtype == CANONICAL[case["num_experts"]]
    assert result.weight_version == "policy-7" and result.prompt_token_ids == tuple(case["prompt"])
    assert "sglext" not in result.raw or "routed_experts" not in result.raw["sglext"]
    # What was sent: fields SGLang's CompletionRequest declares (pydantic there ignores unknown ones).
    declared = set(FIXTURE["request_fields"]["completions"])
    assert set(body) <= declared, set(body) - declared
    assert body["prompt"] == case["prompt"] and body["return_token_ids"] is True and body["cache_salt"] == "v7"
    assert body["return_routed_experts"] is True and body["logprobs"] == 0
    assert body.get("routed_experts_start_len", 0) == case["start"]


def test_a_two_turn_chat_trace_is_keyed_by_the_servers_token_ids():
    chat = FIXTURE["chat"]
    answers = [t["response"] for t in chat["turns"]]
    messages = [{"role": "user", "content": "hi"}]

    async def call(client):
        trace = RoutedExpertTrace(num_layers=3, topk=2, num_experts=chat["num_experts"], name="chat 0")
        results = []
        for _ in range(2):
            r = await client.chat(
                messages,
                {"max_tokens": 4},
                return_routed_experts=True,
                routed_experts_prompt_start=trace.prompt_start,
            )
            trace.record_result(r, prompt_len=len(r.prompt_token_ids), prompt_ids=r.prompt_token_ids)
            results.append(r)
            messages.extend([{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}])
        tokens = list(results[-1].prompt_token_ids) + list(results[-1].response_ids)
        return trace.finalize(len(tokens)), results

    (routes, results), bodies = ask("/v1/chat/completions", answers, call, moe_layers=[1, 2])
    np.testing.assert_array_equal(routes.astype(np.int64), np.array(chat["full_routes"]))
    assert [b.get("routed_experts_start_len", 0) for b in bodies] == [t["start"] for t in chat["turns"]]
    assert [r.prompt_token_ids for r in results] == [tuple(t["expected"]["prompt_token_ids"]) for t in chat["turns"]]
    assert [r.response_ids for r in results] == [tuple(t["expected"]["token_ids"]) for t in chat["turns"]]
    assert results[1].response_logprobs == tuple(chat["turns"][1]["expected"]["logprobs"])
    declared = set(FIXTURE["request_fields"]["chat"])
    for body in bodies:
        assert set(body) <= declared, set(body) - declared
        assert body["return_token_ids"] is True and body["messages"][0] == {"role": "user", "content": "hi"}
        assert "return_meta_info" not in body  # it would move the routes out of sglext


def test_a_chat_answer_without_the_rendered_prompt_ids_is_refused_clearly():
    answer = json.loads(json.dumps(FIXTURE["chat"]["turns"][0]["response"]))
    del answer["choices"][0]["prompt_token_ids"]

    async def call(client):
        return await client.chat([{"role": "user", "content": "hi"}], return_routed_experts=True)

    with pytest.raises(RemoteGenerateError, match=r"prompt_token_ids is missing.*chat template.*server='sglang'"):
        ask("/v1/chat/completions", [answer], call)


def test_a_start_past_the_rendered_prompt_is_refused():
    async def call(client):
        return await client.chat(
            [{"role": "user", "content": "hi"}], return_routed_experts=True, routed_experts_prompt_start=50
        )

    with pytest.raises(RemoteGenerateError, match="routed_experts_start_len 50 is past the 7-token prompt"):
        ask("/v1/chat/completions", [FIXTURE["chat"]["turns"][0]["response"]], call)


def test_missing_routes_name_sglangs_flag_and_null_logprobs_read_as_nan():
    answer = json.loads(json.dumps(FIXTURE["completions"][0]["response"]))
    del answer["sglext"]

    async def call(client):
        return await client.generate([11, 12, 13, 14, 15], {"max_tokens": 4}, return_routed_experts=True)

    with pytest.raises(RemoteGenerateError, match=r"sglext.routed_experts is missing.*--enable-return-routed-experts"):
        ask("/v1/completions", [answer], call)

    answer["choices"][0]["logprobs"]["token_logprobs"][1] = None  # SGLang writes -inf as null

    async def plain(client):
        return await client.generate([11, 12, 13, 14, 15], {"max_tokens": 4})

    result, _ = ask("/v1/completions", [answer], plain)
    assert np.isnan(result.response_logprobs[1]) and result.routed_experts is None


def test_chat_routes_are_health_checked_with_sglangs_hint():
    answer = json.loads(json.dumps(FIXTURE["chat"]["turns"][0]["response"]))
    rows = np.array(FIXTURE["chat"]["turns"][0]["expected"]["routes"], "<i4")
    rows[:, 2] = 0
    answer["sglext"]["routed_experts"] = base64.b64encode(rows.tobytes()).decode()

    async def call(client):
        return await client.chat([{"role": "user", "content": "hi"}], return_routed_experts=True)

    with pytest.raises(RouteHealthError, match="layer 2.*SGLang"):
        ask("/v1/chat/completions", [answer], call, moe_layers=[1, 2])


def test_routes_need_the_shape_before_anything_is_sent():
    async def call(client):
        return await client.chat([{"role": "user", "content": "hi"}], return_routed_experts=True)

    with pytest.raises(ValueError, match="num_layers=.*topk="):
        http_stub.ask("sglang-openai", "/v1/chat/completions", [{}], call)


def test_rows_replayed_from_an_earlier_request_are_refused_by_the_client():
    rng = np.random.default_rng(5)
    rows = np.stack([[rng.permutation(64)[:2] for _ in range(3)] for _ in range(40)]).astype("<i4")  # [40, 3, 2]
    prompts = [rng.integers(100, 200, 37).tolist() for _ in range(2)]
    answers = []
    for prompt in prompts:  # the second answer carries the first's rows again, behind another prompt
        answer = json.loads(json.dumps(FIXTURE["completions"][0]["response"]))
        answer["choices"][0]["prompt_token_ids"] = prompt
        answer["sglext"]["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
        answers.append(answer)

    async def call(client):
        first = await client.generate(prompts[0], {"max_tokens": 4}, return_routed_experts=True)
        try:
            await client.generate(prompts[1], {"max_tokens": 4}, return_routed_experts=True)
        except RouteHealthError as exc:
            return first, exc, client.health.stats
        raise AssertionError("the replayed rows were accepted")

    (first, exc, stats), _ = ask("/v1/completions", answers, call, num_experts=64)
    assert first.routed_experts.shape == (40, 3, 2)
    assert exc.findings[0].kind == "replayed_rows" and "37-token prompt" in exc.findings[0].seen
    assert stats.replayed_rows == 1 and stats.trajectories == 2
