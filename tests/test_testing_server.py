"""torch_r3.testing: any ServedModel plugs in; the server validates requests; docs run."""

from __future__ import annotations

import asyncio
import doctest
import importlib

import numpy as np
import pytest

from torch_r3.client import RemoteGenerateClient, RemoteGenerateError
from torch_r3.testing import GenerateOutput, LoopbackServer, ServedModel

FAST = {"retries": 3, "backoff": 0.01, "max_backoff": 0.05, "timeout": 20.0}


class CountingModel(ServedModel):
    """Generates prompt[-1] + 1, +2, ...; token t at position j is routed to (j % E, (j + 1) % E)."""

    num_layers, num_experts, topk = 3, 300, 2

    def __init__(self, broken: bool = False):
        self.broken = broken

    def generate(self, token_ids, sampling_params):
        n = sampling_params.get("max_new_tokens", 2)
        ids = [token_ids[-1] + i + 1 for i in range(n)]
        rows = len(token_ids) + n - 1 - (1 if self.broken else 0)
        pos = np.arange(rows)[:, None, None]
        routes = np.broadcast_to(np.concatenate([pos, pos + 1], axis=2) % self.num_experts, (rows, 3, 2))
        return GenerateOutput(token_ids=ids, logprobs=[0.0] * n, routes=np.ascontiguousarray(routes), finish_reason="length")


def _call(url, *args, **kwargs):
    async def main():
        async with RemoteGenerateClient(url, **FAST) as client:
            return await client.generate(*args, **kwargs)

    return asyncio.run(main())


def test_a_custom_served_model_plugs_in():
    with LoopbackServer(CountingModel()) as server:
        prompt = list(range(299))
        result = _call(server.url, prompt, {"max_new_tokens": 3}, return_routed_experts=True, routed_experts_prompt_start=250)
    assert list(result.response_ids) == [299, 300, 301]
    rows = np.arange(250, 299 + 3 - 1)
    expected = np.stack([rows % 300, (rows + 1) % 300], axis=1)[:, None, :].repeat(3, axis=1)
    assert result.routed_experts.dtype == np.int16  # ids up to 299 do not fit uint8
    np.testing.assert_array_equal(result.routed_experts, expected)


def test_a_model_returning_the_wrong_row_count_is_a_500():
    with LoopbackServer(CountingModel(broken=True)) as server:
        with pytest.raises(RemoteGenerateError, match=r"HTTP 500: model returned routes of shape \(3, 3, 2\), expected \(4, 3, 2\)"):
            _call(server.url, [1, 2], {"max_new_tokens": 3}, return_routed_experts=True)


def test_only_served_models_are_accepted():
    with pytest.raises(TypeError, match="ServedModel"):
        LoopbackServer(object())


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"token_ids": []}, "at least one token"),
        ({"token_ids": [1], "sampling_params": {"top_q": 1}}, "unsupported sampling_params ['top_q']"),
        ({"token_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be an int >= 1"),
        ({"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 3}, "return_routed_experts": True}, "in [0, 2]"),
        ({"token_ids": [1], "sampling_params": {"routed_experts_prompt_start": 0}}, "requires return_routed_experts"),
        ({"token_ids": "abc"}, "token_ids must be a list of ints"),
        ({"prompt": [1]}, "missing 'token_ids'"),
    ],
)
def test_the_server_answers_bad_requests_with_400_and_a_json_error(body, words):
    import aiohttp

    async def main(url):
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/generate", json=body) as response:
                return response.status, await response.json()

    with LoopbackServer() as server:
        status, payload = asyncio.run(main(server.url))
    assert status == 400 and words in payload["error"]["message"]


def test_async_mode_runs_on_the_current_loop_and_restarts_on_the_same_port():
    async def main():
        async with LoopbackServer() as server:
            port = server.port
            async with RemoteGenerateClient(server.url, **FAST) as client:
                first = await client.generate([1, 2], {"max_new_tokens": 2})
                await server.arestart(downtime=0.05)
                second = await client.generate([1, 2], {"max_new_tokens": 2})
            return port, server.port, first, second

    port, port_after, first, second = asyncio.run(main())
    assert port == port_after and first.response_ids == second.response_ids


@pytest.mark.parametrize(
    "module", ["torch_r3.codec", "torch_r3.trace", "torch_r3.client", "torch_r3.testing", "torch_r3.testing.model", "torch_r3.testing.server"]
)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0
