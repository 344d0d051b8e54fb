"""Routes from a running `vllm serve` through `RemoteGenerateClient(server="vllm-openai")`.

One server for the module's tests (Qwen3-MoE, 4 layers, 16 experts, top-4, a word-level
tokenizer and chat template written by the test), started on a free port of 127.0.0.1 with
routes, prefix caching and chunked prefill (64-token chunks) on. Every route is compared with
the router top-k of an independent `transformers` fp32 forward over the same weights and tokens.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import numpy as np
import pytest

from tests.engines.checkpoints import QWEN3, SPECIALS
from torch_r3 import RemoteGenerateClient, RoutedExpertTrace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# No per-request seed: vLLM 0.30 on a CPU crashes a seeded request whose prompt is prefilled in chunks.
SAMPLING = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
# The ids of words (no special token): sampled text re-renders to the same ids in the next turn.
WORD_IDS = list(range(len(SPECIALS), QWEN3.vocab_size))


def client(url: str) -> RemoteGenerateClient:
    return RemoteGenerateClient(url, server="vllm-openai", num_layers=QWEN3.layers, topk=QWEN3.topk, num_experts=16)


def prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(len(SPECIALS), QWEN3.vocab_size, size=n).tolist()


def prefix_cache_hits(url: str) -> float:
    """The server's prefix-cache hit counter (tokens), from its Prometheus metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = re.findall(r"^vllm:prefix_cache_hits(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert found, "no vllm:prefix_cache_hits counter in /metrics"
    return sum(float(v) for v in found)


def test_token_id_completions_batched_match_the_reference(server, reference, agreement):
    rng = np.random.default_rng(0)
    prompts = [prompt(rng, n) for n in (1, 5, 37, 64, 100, 150)]  # 100 and 150: prefilled in chunks of 64

    async def run():
        async with client(server.url) as c:
            return await asyncio.gather(
                *(c.generate(p, SAMPLING, return_routed_experts=True, model="tiny") for p in prompts)
            )

    results = asyncio.run(run())
    for p, r in zip(prompts, results):
        assert len(r.response_ids) == SAMPLING["max_tokens"]
        assert r.routed_experts.dtype == np.uint8
        agreement.check(r.routed_experts, p + list(r.response_ids), reference["qwen3"], what=f"{len(p)}-token prompt")


def test_prefix_cache_hits_keep_the_routes_of_the_tokens(server, reference, agreement):
    rng = np.random.default_rng(1)
    shared = prompt(rng, 160)
    # (prompt, prompt start): the start of the last one lies inside the cached 128-token block
    asks = [(shared + prompt(rng, 9), 0), (shared + prompt(rng, 30), 0), (shared, 0), (shared + prompt(rng, 5), 50)]

    async def one(p, start):
        async with client(server.url) as c:
            return await c.generate(
                p, SAMPLING, return_routed_experts=True, routed_experts_prompt_start=start or None, model="tiny"
            )

    first = asyncio.run(one(*asks[0]))  # computes the shared prefix
    before = prefix_cache_hits(server.url)
    later = [asyncio.run(one(*a)) for a in asks[1:]]
    assert prefix_cache_hits(server.url) - before >= 3 * 128  # every later prompt reused cached blocks
    for (p, start), r in zip(asks, [first, *later]):
        agreement.check(
            r.routed_experts, p + list(r.response_ids), reference["qwen3"], start=start, what="prefix-cached prompt"
        )


def test_incremental_prompt_starts_across_a_multi_turn_trace(server, reference, agreement):
    rng = np.random.default_rng(2)
    trace = RoutedExpertTrace(num_layers=QWEN3.layers, topk=QWEN3.topk, num_experts=16)
    tokens = prompt(rng, 20)
    starts = []

    async def run():
        nonlocal tokens
        async with client(server.url) as c:
            for _turn in range(3):
                start = trace.prompt_start
                r = await c.generate(
                    tokens, SAMPLING, return_routed_experts=True, routed_experts_prompt_start=start, model="tiny"
                )
                assert r.routed_experts.shape[0] == len(tokens) + len(r.response_ids) - 1 - start
                agreement.check(r.routed_experts, tokens + list(r.response_ids), reference["qwen3"], start=start)
                trace.record_result(r, prompt_len=len(tokens), prompt_ids=tokens)
                starts.append(start)
                tokens = tokens + list(r.response_ids) + prompt(rng, 70)  # the next user turn: chunked

    asyncio.run(run())
    assert starts[0] == 0 and starts[1] > 0 and starts[2] > starts[1]
    # The trace's rows cover the last turn's prompt but its final user turn was never sent:
    # they are the rows of the conversation up to the last generated token.
    generated_end = trace.prompt_start + 1
    routes = trace.finalize(token_count=generated_end)
    agreement.check(routes, tokens[:generated_end], reference["qwen3"], what="finalized trace")


def test_chat_routes_are_keyed_by_the_servers_tokens(server, checkpoints, reference, agreement):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["qwen3"])
    trace = RoutedExpertTrace(num_layers=QWEN3.layers, topk=QWEN3.topk, num_experts=16)
    messages = [{"role": "system", "content": "you are a model"}, {"role": "user", "content": "hello there people"}]
    params = {**SAMPLING, "allowed_token_ids": WORD_IDS}

    async def run():
        async with client(server.url) as c:
            for turn in range(2):
                start = trace.prompt_start
                r = await c.chat(
                    messages, params, return_routed_experts=True, routed_experts_prompt_start=start, model="tiny"
                )
                rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                rendered = list(getattr(rendered, "input_ids", rendered))
                assert list(r.prompt_token_ids) == rendered  # the server rendered with the test's template
                agreement.check(
                    r.routed_experts, list(r.prompt_token_ids) + list(r.response_ids), reference["qwen3"], start=start
                )
                trace.record_result(r, prompt_len=len(r.prompt_token_ids), prompt_ids=r.prompt_token_ids)
                reply = tokenizer.decode(list(r.response_ids))
                messages.append({"role": "assistant", "content": reply})
                messages.append({"role": "user", "content": f"and then {['one', 'two'][turn]} more day"})
                last = list(r.prompt_token_ids) + list(r.response_ids)
        return last

    tokens = asyncio.run(run())
    routes = trace.finalize(token_count=len(tokens))
    agreement.check(routes, tokens, reference["qwen3"], what="finalized chat trace")
