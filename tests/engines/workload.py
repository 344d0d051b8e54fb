"""A mixed request workload against a running vLLM server, for the health tests (`tests.engines.workload`).

`run_workload(url, health)` sends, through one `RemoteGenerateClient(server="vllm-openai")`
whose route-health check is `health` (shared by every request, so rows repeated between
responses are looked for too): eight distinct prompts at once (more than the server's four
sequences, so they queue and batch), one prompt four times at once and twice greedily, a
140-token prefix then four prompts extending it (prefix-cache hits), and two three-turn
conversations sent with `routed_experts_prompt_start`. It returns one `Served` per request: the
prompt, the generated ids, the prompt start and the routes, in the order the answers came.
The checkpoint is `checkpoints.QWEN3`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.engines.checkpoints import QWEN3, SPECIALS
from torch_r3 import RemoteGenerateClient

__all__ = ["Served", "run_workload", "served_rollouts"]

SAMPLED = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@dataclass(frozen=True)
class Served:
    """One request's prompt, generated ids, prompt start and routes `[rows, layers, topk]`."""

    kind: str
    prompt: list[int]
    response: list[int]
    start: int
    routes: np.ndarray


def run_workload(url: str, health: Any, *, seed: int = 30) -> list[Served]:
    """Send the workload (see the module docstring) and return what came back."""
    rng = np.random.default_rng(seed)

    def prompt(n: int) -> list[int]:
        return rng.integers(len(SPECIALS), QWEN3.vocab_size, size=n).tolist()

    async def run() -> list[Served]:
        out: list[Served] = []
        async with RemoteGenerateClient(
            url, server="vllm-openai", num_layers=QWEN3.layers, topk=QWEN3.topk, num_experts=16, health=health
        ) as client:

            async def send(kind: str, p: list[int], params: dict, start: int = 0) -> Served:
                r = await client.generate(
                    p,
                    params,
                    return_routed_experts=True,
                    routed_experts_prompt_start=start if start else None,
                    model="tiny",
                )
                served = Served(kind, p, list(r.response_ids), start, r.routed_experts)
                out.append(served)
                return served

            await asyncio.gather(*(send("batched", prompt(n), SAMPLED) for n in (3, 8, 15, 24, 40, 63, 90, 120)))
            repeated = prompt(50)
            await asyncio.gather(*(send("repeated", repeated, SAMPLED) for _ in range(4)))
            for _ in range(2):
                await send("repeated-greedy", repeated, GREEDY)
            prefix = prompt(140)
            await send("shared-prefix", prefix + prompt(4), SAMPLED)
            await asyncio.gather(*(send("shared-prefix", prefix + prompt(n), SAMPLED) for n in (5, 12, 30)))

            async def conversation() -> None:
                tokens, start = prompt(30), 0
                for _turn in range(3):
                    served = await send("multi-turn", tokens, SAMPLED, start)
                    tokens = tokens + served.response + prompt(20)
                    start = len(served.prompt) + len(served.response) - 1

            await asyncio.gather(conversation(), conversation())
        return out

    return asyncio.run(run())


def served_rollouts(url: str, lengths: tuple[int, ...], *, seed: int) -> tuple[list[list[int]], list[Any]]:
    """One batched request per prompt of each length to the server at `url`: each trajectory's
    token ids (prompt then the 10 sampled tokens) and the routes the server returned for it."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(len(SPECIALS), QWEN3.vocab_size, size=n).tolist() for n in lengths]
    params = {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True}

    async def run() -> list[Any]:
        async with RemoteGenerateClient(url, server="vllm-openai", num_layers=QWEN3.layers, topk=QWEN3.topk) as c:
            return await asyncio.gather(
                *(c.generate(p, params, return_routed_experts=True, model="tiny") for p in prompts)
            )

    results = asyncio.run(run())
    return [p + list(r.response_ids) for p, r in zip(prompts, results)], [r.routed_experts for r in results]
