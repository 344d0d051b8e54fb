"""vLLM's OpenAI-compatible endpoints: answers built by vLLM 0.33.0's own pydantic classes, served on 127.0.0.1.

`fixtures/vllm_openai.json` was written by `fixtures/make_openai_fixtures.py` with
vLLM's `CompletionResponse` / `ChatCompletionResponse` and its `numpy2base64`,
next to the routes each answer must decode to and the request fields vLLM's
request classes declare.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

from tests import http_stub
from torch_r3 import RemoteGenerateClient, RoutedExpertTrace
from torch_r3.errors import RemoteGenerateError
from torch_r3.health.check import RouteHealthError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_openai.json").read_text())


def ask(path: str, answers: list, call, **client_kwargs):
    """Serve `answers` in turn at `path`; run `call(client)`; return its result and the bodies received."""
    kwargs = {"num_layers": FIXTURE["num_layers"], "topk": FIXTURE["topk"], **client_kwargs}
    return http_stub.ask("vllm-openai", path, answers, call, **kwargs)


def test_the_fixture_comes_from_vllm_033():
    assert FIXTURE["vllm"] == "0.33.0"


@pytest.mark.parametrize("case", FIXTURE["completions"], ids=lambda c: c["name"])
def test_completions_with_token_ids_decode_what_vllm_built(case):
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
    np.testing.assert_array_equal(result.routed_experts.astype(np.int64), np.array(want["routes"]))
    assert result.weight_version == "policy-7" and result.prompt_token_ids == tuple(case["prompt"])
    assert "routed_experts" not in result.raw["choices"][0]
    # What was sent: fields vLLM's CompletionRequest declares (it ignores unknown ones silently).
    assert set(body) <= set(FIXTURE["request_fields"]["completions"]), set(body) - set(
        FIXTURE["request_fields"]["completions"]
    )
    assert body["prompt"] == case["prompt"] and body["return_token_ids"] is True and body["cache_salt"] == "v7"
    assert body.get("routed_experts_prompt_start", 0) == case["start"]


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
    assert [b.get("routed_experts_prompt_start", 0) for b in bodies] == [t["start"] for t in chat["turns"]]
    assert [r.prompt_token_ids for r in results] == [tuple(t["expected"]["prompt_token_ids"]) for t in chat["turns"]]
    assert results[1].response_logprobs == tuple(chat["turns"][1]["expected"]["logprobs"])
    for body in bodies:
        assert set(body) <= set(FIXTURE["request_fields"]["chat"]), set(body) - set(FIXTURE["request_fields"]["chat"])
        assert body["return_token_ids"] is True and body["messages"][0] == {"role": "user", "content": "hi"}


def test_a_chat_template_that_re_renders_an_earlier_turn_is_refused_by_the_trace():
    chat = FIXTURE["chat"]
    second = json.loads(json.dumps(chat["turns"][1]["response"]))
    second["prompt_token_ids"][3] = 77  # the template rewrote a token of turn 1 (e.g. stripped reasoning)
    answers = [chat["turns"][0]["response"], second]

    async def call(client):
        trace = RoutedExpertTrace()
        for _ in range(2):
            r = await client.chat(
                [{"role": "user", "content": "hi"}],
                return_routed_experts=True,
                routed_experts_prompt_start=trace.prompt_start,
            )
            trace.record_result(r, prompt_len=len(r.prompt_token_ids), prompt_ids=r.prompt_token_ids)

    with pytest.raises(ValueError, match=r"prompt_ids\[3\] = 77.*re-rendered"):
        ask("/v1/chat/completions", answers, call)


def test_a_chat_answer_without_the_rendered_prompt_ids_is_refused_clearly():
    answer = json.loads(json.dumps(FIXTURE["chat"]["turns"][0]["response"]))
    del answer["prompt_token_ids"]

    async def call(client):
        return await client.chat([{"role": "user", "content": "hi"}], return_routed_experts=True)

    with pytest.raises(RemoteGenerateError, match="prompt_token_ids is missing.*chat template"):
        ask("/v1/chat/completions", [answer], call)


def test_chat_routes_are_health_checked():
    answer = json.loads(json.dumps(FIXTURE["chat"]["turns"][0]["response"]))
    rows = np.array(FIXTURE["chat"]["turns"][0]["expected"]["routes"], np.uint8)
    rows[:, 2] = 0
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    answer["choices"][0]["routed_experts"] = base64.b64encode(buf.getvalue()).decode()

    async def call(client):
        return await client.chat([{"role": "user", "content": "hi"}], return_routed_experts=True)

    with pytest.raises(RouteHealthError, match="layer 2"):
        ask("/v1/chat/completions", [answer], call, moe_layers=[1, 2])


def test_chat_needs_the_vllm_openai_server_and_messages():
    async def wrong(url):
        async with RemoteGenerateClient(url, server="sglang") as client:
            await client.chat([{"role": "user", "content": "hi"}])

    with pytest.raises(ValueError, match="server='vllm-openai'"):
        asyncio.run(wrong("http://127.0.0.1:9"))

    async def bad(url):
        async with RemoteGenerateClient(url, server="vllm-openai") as client:
            await client.chat("hi")

    with pytest.raises(TypeError, match="messages must be a list"):
        asyncio.run(bad("http://127.0.0.1:9"))


def test_missing_routes_name_the_vllm_switches():
    answer = json.loads(json.dumps(FIXTURE["completions"][0]["response"]))
    answer["choices"][0]["routed_experts"] = None

    async def call(client):
        return await client.generate([11, 12, 13, 14, 15], {"max_tokens": 4}, return_routed_experts=True)

    with pytest.raises(RemoteGenerateError, match=r"--aux-output-config.*Model Runner V2.*pipeline parallelism"):
        ask("/v1/completions", [answer], call)


def test_completions_ask_for_log_prob_tokens_by_id_so_a_server_without_a_tokenizer_answers():
    # vLLM names each log-prob's token as text unless asked for ids; with --skip-tokenizer-init
    # it cannot, and refuses the request (tests/engines/test_vllm_no_tokenizer.py runs the server).
    from torch_r3.rollout.protocols import PROTOCOLS, GenerateCall

    protocol = PROTOCOLS["vllm-openai"]
    body = protocol.request_body(GenerateCall([1, 2, 3], {"max_tokens": 2}, True))
    assert body["logprobs"] == 1 and body["return_tokens_as_token_ids"] is True
    own = protocol.request_body(GenerateCall([1, 2, 3], {"return_tokens_as_token_ids": False}, True))
    assert own["return_tokens_as_token_ids"] is False  # the caller's own choice is sent as given
