"""The whole route tax of one RL step on the CPU: response bodies to per-rank batches, per stage, per million tokens.

One frontier-shaped step (by default 256 trajectories of 4096 tokens, DeepSeek-V3's shape: 61 layers, 256
experts, top-8, every layer sent) is taken through the path a trainer's driver runs, stage by stage:

* `parse`: `parse_body` of the SGLang `/generate` response body (the route text located in place, the
  rest parsed as JSON);
* `decode`: the SGLang protocol's `parse_response` (the base64 int32 routes -> the canonical `uint8`
  array, the ids and log-probs);
* `health`: the client's default `RouteHealthCheck` with the token ids and the replayed-rows memory,
  one check shared by the whole step (as one client's);
* `trace`: `RoutedExpertTrace.record_result` (the rows appended, trusted: the client checked them) and
  `finalize`, one trace per trajectory;
* `collate`: every data-parallel rank's `ShardCollator` batches (`layout="padded"`, `--dp` ranks,
  micro-batches of `--micro-batch` samples) from the finalized routes;
* `memcpy`: a copy of the same response bodies into buffers that already exist (the floor).

Each stage's CPU time is `time.process_time` of this process (the decode pool is not used: every
stage runs on this thread), summed over the step, and reported as CPU-seconds per million tokens,
and as a multiple of the memcpy of the same bytes. The step runs `--rounds` times, the stages
interleaved per trajectory; bodies are made (untimed) one trajectory at a time, so the step never
holds more than one body. The routes are drawn like a real router's (Zipf-skewed top-8), each
trajectory's rows a fresh permutation, so no check ever finds a replay.

    PYTHONPATH=. python benchmarks/route_tax.py                       # 256 x 4096, DeepSeek-V3 shape, 3 rounds
    PYTHONPATH=. python benchmarks/route_tax.py --trajectories 64 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.health_bench import router_like
from torch_r3 import RemoteGenerateResult, RoutedExpertTrace, ShardCollator
from torch_r3.health.check import RouteHealthCheck
from torch_r3.keys import ROUTES
from torch_r3.rollout.protocols import PROTOCOLS
from torch_r3.rollout.protocols.base import GenerateCall, RouteLimits
from torch_r3.rollout.protocols.spans import parse_body

STAGES = ("parse", "decode", "health", "trace", "collate")
SGLANG = PROTOCOLS["sglang"]


def sglang_body(routes: np.ndarray, prompt: list[int], generated: list[int], rng: np.random.Generator) -> bytes:
    """An SGLang `/generate` body with `routes` (every position but the last) as base64 int32."""
    meta = {
        "id": "tax",
        "finish_reason": {"type": "length", "length": len(generated)},
        "prompt_tokens": len(prompt),
        "completion_tokens": len(generated),
        "cached_tokens": 0,
        "output_token_logprobs": [
            [round(-float(x), 6), t, None] for x, t in zip(rng.random(len(generated)), generated)
        ],
        "routed_experts": base64.b64encode(routes.astype("<i4").tobytes()).decode(),
        "weight_version": "1",
    }
    return json.dumps({"text": "x" * len(generated), "output_ids": generated, "meta_info": meta}).encode()


def cpu(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """`fn(*args, **kwargs)` and the CPU seconds it took (this process)."""
    t = time.process_time()
    out = fn(*args, **kwargs)
    return time.process_time() - t, out


def traced(result: RemoteGenerateResult, name: str, prompt: list[int], args: argparse.Namespace) -> np.ndarray:
    """One trajectory's trace: its one turn recorded from the client's result, then finalized."""
    trace = RoutedExpertTrace(num_layers=args.layers, topk=args.topk, num_experts=args.experts, name=name)
    trace.record_result(result, prompt_len=len(prompt), prompt_ids=prompt)
    return trace.finalize(args.tokens)


def collate(finalized: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """Every rank's `ShardCollator` batches, consumed one after the other; the samples they held."""
    samples = 0
    for rank in np.array_split(np.arange(len(finalized)), args.dp):
        micro = [m.tolist() for m in np.array_split(rank, max(1, len(rank) // args.micro_batch))]
        shard = ShardCollator(
            lambda idx: [finalized[j] for j in idx], micro, layout="padded", pad_token_id=0, num_experts=args.experts
        )
        for batch in shard:
            samples += batch[ROUTES].shape[0]
    return samples


def one_step(args: argparse.Namespace, base: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
    """One step's CPU seconds per stage (and the memcpy floor)."""
    limits = RouteLimits(max_bytes=1 << 34, num_layers=args.layers, topk=args.topk, num_experts=args.experts)
    health = RouteHealthCheck(engine="sglang")
    spent = dict.fromkeys((*STAGES, "memcpy"), 0.0)
    prompt_len = args.tokens // 4
    finalized: list[dict[str, Any]] = []
    scratch = bytearray()
    for i in range(args.trajectories):
        routes = np.ascontiguousarray(base[rng.permutation(base.shape[0])])
        ids = rng.integers(3, 150_000, args.tokens).tolist()
        prompt, generated = ids[:prompt_len], ids[prompt_len:]
        body = sglang_body(routes, prompt, generated, rng)
        if len(scratch) != len(body):
            scratch = bytearray(len(body))
        spent["memcpy"] += cpu(scratch.__setitem__, slice(None), body)[0]
        call = GenerateCall(prompt, {"max_new_tokens": len(generated)}, True)
        t, raw = cpu(parse_body, body, SGLANG.route_text_paths)
        spent["parse"] += t
        t, parsed = cpu(SGLANG.parse_response, raw, call, limits)
        spent["decode"] += t
        rows = parsed.routed_experts
        tokens = (prompt + list(parsed.response_ids))[: rows.shape[0]]
        t, _ = cpu(health.check, rows, trajectory=f"t{i}", token_ids=tokens)
        spent["health"] += t
        result = RemoteGenerateResult(**vars(parsed), num_experts=args.experts, raw=None, health_checked=True)
        t, final = cpu(traced, result, f"t{i}", prompt, args)
        spent["trace"] += t
        assert final.dtype == np.uint8 and np.array_equal(final, routes), i  # the body's routes, untouched
        finalized.append({"input_ids": np.asarray(ids), "routes": final})
    assert health.stats.refused == 0 and health.stats.trajectories == args.trajectories
    t, samples = cpu(collate, finalized, args)
    assert samples == args.trajectories
    spent["collate"] += t
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dp", type=int, default=8, help="data-parallel ranks")
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    base = router_like(rng, args.tokens - 1, args.layers, args.experts, args.topk)
    tokens = args.trajectories * args.tokens
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        spent = one_step(args, base, rng)
        rounds.append({"load": load, "per_million": {k: v / tokens * 1e6 for k, v in spent.items()}})
        total = sum(rounds[-1]["per_million"][k] for k in STAGES)
        print(f"round {r}: load {load:.1f}, total {total:.2f} CPU-s per 1M tokens", flush=True)
    print(
        f"{args.trajectories} trajectories x {args.tokens} tokens, {args.layers} layers, {args.experts} experts, "
        f"top-{args.topk}; CPU-seconds per million tokens, median of {args.rounds} rounds (per round in brackets)"
    )
    floor = statistics.median(r["per_million"]["memcpy"] for r in rounds)
    totals = [sum(r["per_million"][k] for k in STAGES) for r in rounds]
    for key in (*STAGES, "memcpy"):
        values = [r["per_million"][key] for r in rounds]
        med = statistics.median(values)
        share = f"{med / statistics.median(totals):6.1%}" if key != "memcpy" else "      "
        print(
            f"{key:<10}{med:8.3f} s {share} {med / floor:8.1f}x memcpy  [" + ", ".join(f"{v:.3f}" for v in values) + "]"
        )
    print(f"{'total':<10}{statistics.median(totals):8.3f} s        {statistics.median(totals) / floor:8.1f}x memcpy")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
