"""The loopback server speaks vLLM's `/v1/completions`, Megatron's and SkyRL's shapes, and the client reads them.

A five-turn rollout through each protocol is stitched by `RoutedExpertTrace` and
compared with the routes of one request over the whole conversation (the tiny
model routes each position the same way whatever the request), and a server
without routes gets each engine's own advice.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from torch_r3 import RemoteGenerateClient, RoutedExpertTrace
from torch_r3.errors import RemoteGenerateError
from torch_r3.testing import LoopbackServer

PROTOCOLS = ["vllm-openai", "megatron", "skyrl"]


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
        ("megatron", r"moe_enable_routing_replay"),
        ("skyrl", r"enable_return_routed_experts.*moe_enable_routing_replay"),
    ],
)
def test_a_server_without_routes_gets_the_engines_own_advice(protocol, advice):
    async def main(url):
        async with RemoteGenerateClient(url, server=protocol, retries=0) as client:
            await client.generate([3, 4, 5], {"max_tokens": 2}, return_routed_experts=True)

    with LoopbackServer(protocol=protocol, routes_enabled=False) as server:
        with pytest.raises(RemoteGenerateError, match=advice):
            asyncio.run(main(server.url))
