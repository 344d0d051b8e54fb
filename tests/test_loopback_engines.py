"""The loopback server speaks the OpenAI-compatible, Megatron and SkyRL shapes, and the client reads them.

A five-turn rollout through each protocol is stitched by `RoutedExpertTrace` and
compared with the routes of one request over the whole conversation (the tiny
model routes each position the same way whatever the request), and a server
without routes gets each engine's own advice. Chat rollouts go through the
server's own chat template: the trace is keyed by the token ids the server
rendered, and its rows are checked against the model's own forward pass over
those tokens.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from torch_r3 import RemoteGenerateClient, RoutedExpertTrace
from torch_r3.errors import RemoteGenerateError
from torch_r3.rollout.transport import TransportConfig
from torch_r3.testing import LoopbackServer, TinyMoELM
from torch_r3.testing._wire.chat import ROLES, START

PROTOCOLS = ["vllm-openai", "sglang-openai", "megatron", "skyrl"]
CHAT = ["vllm-openai", "sglang-openai"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_multi_turn_rollout_matches_one_request_over_the_conversation(protocol):
    async def main(url):
        async with RemoteGenerateClient(url, server=protocol, num_layers=2, topk=2, moe_layers=[0, 1]) as client:
            trace = RoutedExpertTrace(num_layers=2, topk=2, name="rollout")
            conversation = [3, 4, 5]
            for _ in range(5):
                r = await client.generate(
                    conversation,
                    {"max_tokens": 2},
                    return_routed_experts=True,
                    routed_experts_prompt_start=trace.prompt_start,
                )
                trace.record_result(r, prompt_len=len(conversation), prompt_ids=conversation)
                conversation = conversation + list(r.response_ids) + [7]
            whole = await client.generate(conversation[:-1], {"max_tokens": 1}, return_routed_experts=True)
            return trace.finalize(len(conversation)), whole, r, len(conversation)

    with LoopbackServer(protocol=protocol) as server:
        routes, whole, last, tokens = asyncio.run(main(server.url))
    assert routes.shape[0] == tokens - 2  # the last sampled token and the final observation never ran forward
    np.testing.assert_array_equal(routes, whole.routed_experts[: routes.shape[0]])
    assert last.response_logprobs is not None and len(last.response_logprobs) == len(last.response_ids)


@pytest.mark.parametrize(
    ("protocol", "advice"),
    [
        ("vllm-openai", r"--aux-output-config.*VLLM_USE_V2_MODEL_RUNNER"),
        ("sglang-openai", r"sglext.routed_experts is missing.*--enable-return-routed-experts"),
        ("megatron", r"moe_enable_routing_replay"),
        ("skyrl", r"enable_return_routed_experts.*moe_enable_routing_replay"),
    ],
)
def test_a_server_without_routes_gets_the_engines_own_advice(protocol, advice):
    async def main(url):
        async with RemoteGenerateClient(
            url, server=protocol, num_layers=2, topk=2, transport_config=TransportConfig(retries=0)
        ) as client:
            await client.generate([3, 4, 5], {"max_tokens": 2}, return_routed_experts=True)

    with LoopbackServer(protocol=protocol, routes_enabled=False) as server:
        with pytest.raises(RemoteGenerateError, match=advice):
            asyncio.run(main(server.url))


@pytest.mark.parametrize("protocol", CHAT)
def test_a_chat_rollout_is_keyed_by_the_tokens_the_server_rendered(protocol):
    model = TinyMoELM(num_layers=3, first_k_dense=1, vocab_size=64)
    turns = ["What is 2+2?", "And times 3?", [{"type": "text", "text": "Thanks."}]]

    async def main(url):
        async with RemoteGenerateClient(url, server=protocol, num_layers=3, topk=2, moe_layers=[1, 2]) as client:
            trace = RoutedExpertTrace(num_layers=3, topk=2, name="chat 0")
            messages, results = [], []
            for text in turns:
                messages.append({"role": "user", "content": text})
                r = await client.chat(
                    messages,
                    {"max_tokens": 3, "temperature": 0.0},
                    return_routed_experts=True,
                    routed_experts_prompt_start=trace.prompt_start,
                    cache_salt="policy-0",
                )
                trace.record_result(r, prompt_len=len(r.prompt_token_ids), prompt_ids=r.prompt_token_ids)
                results.append(r)
                # What an agent loop sends back: the answer's text, which the server re-renders.
                messages.append({"role": "assistant", "content": r.raw["choices"][0]["message"]["content"]})
            tokens = list(results[-1].prompt_token_ids) + list(results[-1].response_ids)
            return trace.finalize(len(tokens)), results, tokens

    with LoopbackServer(model, protocol=protocol) as server:
        routes, results, tokens = asyncio.run(main(server.url))
    # The server's tokens, not the caller's text: the template's start/role tokens lead every turn's prompt.
    assert [r.prompt_token_ids[:2] for r in results] == [(START, ROLES["user"])] * len(turns)
    for before, after in zip(results, results[1:]):
        # Each turn's rendering extends the previous prompt and answer (then END and the new messages).
        assert after.prompt_token_ids[: len(before.prompt_token_ids) + len(before.response_ids)] == (
            before.prompt_token_ids + before.response_ids
        )
    # The stitched rows are the model's own routes over the server's tokens (every position but the last).
    _, reference = model.forward(tokens[:-1])
    np.testing.assert_array_equal(routes.astype(np.int64), reference.numpy())
    assert all(len(r.response_logprobs) == len(r.response_ids) for r in results)
