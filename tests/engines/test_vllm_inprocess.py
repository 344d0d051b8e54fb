"""Routes from in-process vLLM (`vllm.LLM`, `vllm.AsyncLLM`) through `torch_r3.rollout.inprocess`.

Two more checkpoints than the server's: OLMoE (3 layers, 8 experts, top-2) in an `LLM` in this
process, and a Qwen3-MoE with 320 experts (past 256: vLLM sends `uint16`) in an `AsyncLLM`
whose engine core runs in a child process; and vLLM's own merge of DELTA outputs, which drops
the routes. Every route is compared with the router top-k of an
independent `transformers` fp32 forward over the same weights and tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from tests.engines.checkpoints import OLMOE, QWEN3_WIDE
from torch_r3 import RoutedExpertTrace
from torch_r3.rollout.inprocess import collect_vllm_stream, vllm_results

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OLMOE_SHAPE = {"num_layers": OLMOE.layers, "topk": OLMOE.topk, "num_experts": OLMOE.num_experts}
WIDE_SHAPE = {"num_layers": QWEN3_WIDE.layers, "topk": QWEN3_WIDE.topk, "num_experts": QWEN3_WIDE.num_experts}


def sampling(**overrides):
    from vllm import SamplingParams

    # No per-request seed: vLLM 0.30 on a CPU crashes a seeded request whose prompt is prefilled in chunks.
    return SamplingParams(**{"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "detokenize": False, **overrides})


def tokens_prompt(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


@pytest.fixture(scope="module")
def llm(checkpoints) -> Iterator[object]:
    """vLLM's `LLM` over the OLMoE checkpoint, in this process; closed when the module ends."""
    from tests.engines.engines import close_llm, in_process_llm

    engine = in_process_llm(checkpoints["olmoe"])
    yield engine
    close_llm(engine)


def test_llm_n_samples_match_the_reference(llm, reference, agreement):
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, OLMOE.vocab_size, size=n).tolist() for n in (2, 70, 130)]
    outputs = llm.generate([tokens_prompt(p) for p in prompts], sampling(n=3, logprobs=0), use_tqdm=False)
    for p, out in zip(prompts, outputs):
        results = vllm_results(out, **OLMOE_SHAPE)
        assert len(results) == 3
        for r in results:
            assert r.response_logprobs is not None and len(r.response_logprobs) == len(r.response_ids) == 6
            agreement.check(r.routed_experts, p + list(r.response_ids), reference["olmoe"], what=f"n=3, {len(p)}")
        # Every sample carries the same prompt rows (the prompt was run once).
        for r in results[1:]:
            np.testing.assert_array_equal(r.routed_experts[: len(p) - 1], results[0].routed_experts[: len(p) - 1])


def test_llm_multi_turn_trace_with_prefix_cache_and_prompt_starts(llm, reference, agreement):
    rng = np.random.default_rng(11)
    trace = RoutedExpertTrace(**OLMOE_SHAPE)
    tokens = rng.integers(0, OLMOE.vocab_size, size=140).tolist()  # past one 128-token cache block
    for _turn in range(3):
        start = trace.prompt_start
        (out,) = llm.generate([tokens_prompt(tokens)], sampling(routed_experts_prompt_start=start), use_tqdm=False)
        if start:
            assert out.num_cached_tokens > 0  # the earlier turns' blocks were reused
        (r,) = vllm_results(out, routed_experts_prompt_start=start, **OLMOE_SHAPE)
        agreement.check(r.routed_experts, tokens + list(r.response_ids), reference["olmoe"], start=start)
        trace.record_result(r, prompt_len=len(tokens), prompt_ids=tokens)
        tokens = tokens + list(r.response_ids)
        held = len(tokens)
        tokens = tokens + rng.integers(0, OLMOE.vocab_size, size=40).tolist()
    agreement.check(trace.finalize(token_count=held), tokens[:held], reference["olmoe"], what="finalized trace")


def test_async_llm_streams_past_256_experts(checkpoints, reference, agreement):
    """`AsyncLLM` in CUMULATIVE and FINAL_ONLY mode, `n=2`, a prompt start: the `uint16` path end to end.

    Not DELTA: vLLM merges DELTA outputs a busy consumer has not taken yet and drops their routes
    (`test_vllms_delta_merge_drops_routes_and_the_collector_says_so`).
    """
    from vllm.sampling_params import RequestOutputKind

    from tests.engines.engines import async_llm

    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, QWEN3_WIDE.vocab_size, size=n).tolist() for n in (40, 100)]
    model = reference["wide"]

    async def run():
        with async_llm(checkpoints["wide"]) as engine:
            seen = {}

            async def stream(i, p, kind, start):
                params = sampling(n=2, output_kind=kind, routed_experts_prompt_start=start)
                async for out in engine.generate(tokens_prompt(p), params, request_id=f"r{i}"):
                    for c in out.outputs:
                        if c.routed_experts is not None:
                            seen[(i, c.index)] = c.routed_experts.dtype
                    yield out

            cumulative, final = await asyncio.gather(
                collect_vllm_stream(stream(0, prompts[0], RequestOutputKind.CUMULATIVE, 0), delta=False, **WIDE_SHAPE),
                collect_vllm_stream(
                    stream(1, prompts[1], RequestOutputKind.FINAL_ONLY, 30),
                    delta=False,
                    routed_experts_prompt_start=30,
                    **WIDE_SHAPE,
                ),
            )
            return cumulative, final, seen

    cumulative, final, seen = asyncio.run(run())
    assert set(seen.values()) == {np.dtype(np.uint16)}  # what vLLM sends past 256 experts
    widest = 0
    for results, p, start in ((cumulative, prompts[0], 0), (final, prompts[1], 30)):
        assert len(results) == 2
        for r in results:
            assert r.routed_experts.dtype == np.int16  # ids past 255 kept, never wrapped
            widest = max(widest, int(r.routed_experts.max()))
            agreement.check(r.routed_experts, p + list(r.response_ids), model, start=start, what=f"{len(p)}, wide")
    assert widest > 255


def test_vllms_delta_merge_drops_routes_and_the_collector_says_so():
    """vLLM's own merge of pending DELTA outputs (what its AsyncLLM does when the consumer falls behind)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from torch_r3.rollout.inprocess import VLLMOutputCollector

    routes = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2) % 8  # 3 + 3 - 1 rows

    def output(tokens, finished):
        done = "length" if finished else None
        c = CompletionOutput(
            index=0,
            text="",
            token_ids=tokens,
            cumulative_logprob=None,
            logprobs=None,
            finish_reason=done,
            routed_experts=routes if finished else None,
        )
        return RequestOutput("r", None, [1, 2, 3], None, [c], finished=finished)

    pending = output([7], finished=False)
    pending.add(output([8, 9], finished=True), aggregate=True)  # the consumer had not taken `pending` yet
    assert pending.finished and list(pending.outputs[0].token_ids) == [7, 8, 9]
    assert pending.outputs[0].routed_experts is None  # the merge kept the tokens, not the routes
    collector = VLLMOutputCollector(delta=True)
    collector.add(pending)
    with pytest.raises(ValueError, match="DELTA stream: .*merges .* drops routed_experts.*CUMULATIVE"):
        collector.results(**OLMOE_SHAPE)
    unmerged = VLLMOutputCollector(delta=True)  # the same two outputs, taken one by one
    unmerged.add(output([7], finished=False))
    unmerged.add(output([8, 9], finished=True))
    (r,) = unmerged.results(**OLMOE_SHAPE)
    np.testing.assert_array_equal(r.routed_experts, routes)
