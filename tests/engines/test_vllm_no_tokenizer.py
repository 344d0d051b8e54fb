"""`RemoteGenerateClient` with its default options against `vllm serve --skip-tokenizer-init`.

RL stacks commonly run the server without a tokenizer: they send token ids and never read text.
vLLM 0.30 then refuses (HTTP 400, "Unable to get tokenizer because `skip_tokenizer_init=True`")
any completion whose log-prob block would name its tokens as text, which the client's default
`logprobs: 1` asks for, unless the request says `return_tokens_as_token_ids`. One server for
the module (OLMoE, 3 layers, 8 experts, top-2, no tokenizer files in the checkpoint); every
route is compared with the router top-k of an independent `transformers` fp32 forward.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.engines.checkpoints import OLMOE
from torch_r3 import RemoteGenerateClient, RoutedExpertTrace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SAMPLING = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def bare_server(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """`vllm serve --skip-tokenizer-init` over the OLMoE checkpoint."""
    from tests.engines.engines import VLLMServer

    log = tmp_path_factory.mktemp("bare_server") / "vllm.log"
    with VLLMServer(checkpoints["olmoe"], log, tokenizer=False) as running:
        assert "--skip-tokenizer-init" in running.command()
        yield running


def test_default_requests_work_against_a_server_without_a_tokenizer(bare_server, reference, agreement):
    rng = np.random.default_rng(3)
    first = rng.integers(0, OLMOE.vocab_size, size=9).tolist()
    trace = RoutedExpertTrace(num_layers=OLMOE.layers, topk=OLMOE.topk, num_experts=OLMOE.num_experts)

    async def run():
        async with RemoteGenerateClient(bare_server.url, server="vllm-openai") as client:  # default options
            one = await client.generate(first, SAMPLING, return_routed_experts=True)
            trace.record_result(one, prompt_len=len(first))
            second = [*first, *one.response_ids, *rng.integers(0, OLMOE.vocab_size, size=4).tolist()]
            two = await client.generate(
                second, SAMPLING, return_routed_experts=True, routed_experts_prompt_start=trace.prompt_start
            )
            trace.record_result(two, prompt_len=len(second))
            return one, second, two

    one, second, two = asyncio.run(run())
    for r in (one, two):
        assert len(r.response_ids) == SAMPLING["max_tokens"]
        # the sampled tokens' log-probs arrive (as numbers; vLLM named their tokens by id, not as text)
        assert r.response_logprobs is not None and len(r.response_logprobs) == len(r.response_ids)
        assert all(math.isfinite(x) and x <= 0 for x in r.response_logprobs)
    model = reference["olmoe"]
    agreement.check(one.routed_experts, first + list(one.response_ids), model, what="no tokenizer, turn 1")
    agreement.check(
        two.routed_experts, second + list(two.response_ids), model, start=len(first) + 5, what="no tokenizer, turn 2"
    )
    tokens = second + list(two.response_ids)
    agreement.check(trace.finalize(token_count=len(tokens)), tokens, model, what="no tokenizer, finalized trace")
