"""Multi-turn rollouts from SGLang or vLLM into one `R3Collator` batch.

Against a real server (started with `--enable-return-routed-experts`), give its
URL and the model's routing shape, every hidden layer counted:

    python examples/server_rollout.py --server sglang --url http://127.0.0.1:30000 \\
        --num-layers 48 --topk 8 --num-experts 128 --vocab-size 151936
    python examples/server_rollout.py --server vllm --url http://127.0.0.1:8000 \\
        --num-layers 48 --topk 8 --num-experts 128 --vocab-size 151936

Without `--url` it starts `torch_r3.testing.LoopbackServer` speaking that
server's protocol (a tiny MoE model whose first layer is dense) and checks the
batch against one request over each whole conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import numpy as np
from torch.utils.data import DataLoader

from torch_r3 import R3Collator, RemoteGenerateClient, RoutedExpertTrace


def max_key(server: str) -> str:
    """The server's name for the number of tokens to generate."""
    return "max_tokens" if server == "vllm" else "max_new_tokens"


async def rollout(client: RemoteGenerateClient, prompt: list[int], *, turns: int, max_key: str, observation) -> dict:
    """One multi-turn trajectory: each turn asks only for the rows not held yet."""
    trace, tokens = RoutedExpertTrace(), list(prompt)
    for turn in range(turns):
        result = await client.generate(
            tokens, {max_key: 8}, return_routed_experts=True, routed_experts_prompt_start=trace.prompt_start
        )
        # Routes, generated count and weight versions (a turn that straddled a weight
        # update is refused); prompt_ids refuses a history the chat template re-rendered.
        trace.record_result(result, prompt_len=len(tokens), prompt_ids=tokens)
        tokens += result.response_ids
        if result.finish_reason != "length" or turn == turns - 1:
            break
        tokens += observation()  # a tool's answer joins the conversation
    return {"input_ids": tokens, "routes": trace.finalize(token_count=len(tokens))}


async def collect(url: str, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab_size) for _ in range(12)] for _ in range(args.trajectories)]
    async with RemoteGenerateClient(
        url,
        server=args.server,
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        # One salt per policy version: no prefix cached by older weights is reused.
        cache_salt=f"policy-v{args.policy_version}",
    ) as client:
        return await asyncio.gather(
            *(
                rollout(
                    client,
                    p,
                    turns=args.turns,
                    max_key=max_key(args.server),
                    observation=lambda: [rng.randrange(args.vocab_size) for _ in range(3)],
                )
                for p in prompts
            )
        )


def check_against_one_request(url: str, args: argparse.Namespace, samples: list[dict]) -> None:
    """Each trajectory's routes equal those of one request over its whole conversation."""

    async def main():
        async with RemoteGenerateClient(url, server=args.server, num_layers=args.num_layers, topk=args.topk) as client:
            for sample in samples:
                tokens = sample["input_ids"]
                whole = await client.generate(
                    tokens[:-1],
                    {max_key(args.server): 1},
                    return_routed_experts=True,
                    cache_salt=f"policy-v{args.policy_version}",
                )
                assert np.array_equal(whole.routed_experts, sample["routes"]), "multi-turn routes differ"

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["sglang", "vllm", "torch_r3"], default="sglang")
    parser.add_argument("--url", help="the server; omitted: a loopback server speaking --server's protocol")
    parser.add_argument("--num-layers", type=int, default=3, help="hidden layers of the model (dense ones included)")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=64)
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--policy-version", type=int, default=0)
    args = parser.parse_args(argv)

    if args.url:
        samples = asyncio.run(collect(args.url, args))
    else:
        from torch_r3.testing import LoopbackServer, TinyMoELM

        model = TinyMoELM(
            num_layers=args.num_layers,
            topk=args.topk,
            num_experts=args.num_experts,
            vocab_size=args.vocab_size,
            first_k_dense=1,
        )
        with LoopbackServer(model, protocol=args.server) as server:
            samples = asyncio.run(collect(server.url, args))
            check_against_one_request(server.url, args, samples)

    loader = DataLoader(samples, batch_size=len(samples), collate_fn=R3Collator(pad_token_id=0))
    batch = next(iter(loader))
    print(
        f"{args.server}: {len(samples)} trajectories -> " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
