"""The trainer layouts side by side: same batch, one process, interleaved rounds, medians.

Every layout of `collate_routes` on identical input (ragged RL lengths, 40 layers,
top-8, uint8), into recycled buffers (`BufferPool`, as `R3Collator` does), so the
figures compare the writers, not first-touch page faults. Before timing, every
layout's output is checked against a straightforward NumPy construction of the
same layout (captured rows in place, masks), so a fast wrong writer cannot win.

    PYTHONPATH=. python benchmarks/layouts.py [--batch 64] [--max-tokens 4096] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from torch_r3 import BufferPool, Memory, Packed, Padded, PromptResponse, collate_routes

L, K, EXPERTS = 40, 8, 128


def make_batch(batch: int, max_tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    counts = np.clip(rng.lognormal(np.log(max_tokens / 4), 0.8, batch), 16, max_tokens).astype(int).tolist()
    prompts = [int(rng.integers(1, min(n, max_tokens // 4) + 1)) for n in counts]
    routes = [rng.integers(0, EXPERTS, (n - 1, L, K), dtype=np.uint8) for n in counts]
    return routes, counts, prompts


def layouts(counts, prompts):
    P = max(prompts)
    R = max(n - p for n, p in zip(counts, prompts))
    return {
        "padded left": {"layout": Padded()},
        "padded right": {"layout": Padded(side="right")},
        "prompt_response": {"layout": PromptResponse(prompt_width=P, response_width=R), "prompt_lengths": prompts},
        "packed": {"layout": Packed()},
        "packed aligned 128": {"layout": Packed(pad_to_multiple_of=128)},
    }


def check(name, out, routes, counts, prompts, opts):
    got = out["rollout_expert_indices"].numpy()
    captured = ~out["router_padding_mask"].numpy()
    layout = opts["layout"]
    if isinstance(layout, Packed):
        offsets = out.get("cu_seqlens_padded", out["cu_seqlens"]).tolist()
        starts = offsets[:-1]
        rows = [got[s : s + r.shape[0]] for s, r in zip(starts, routes)]
        assert captured.sum() == sum(r.shape[0] for r in routes), name
    else:
        T = got.shape[1]
        if isinstance(layout, PromptResponse):
            starts = [layout.prompt_width - p for p in prompts]
        else:
            starts = [T - n if layout.side == "left" else 0 for n in counts]
        rows = [got[i, s : s + r.shape[0]] for i, (s, r) in enumerate(zip(starts, routes))]
        assert captured.sum() == sum(r.shape[0] for r in routes), name
    for i, (a, b) in enumerate(zip(rows, routes)):
        assert np.array_equal(a, b), (name, i)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    routes, counts, prompts = make_batch(args.batch, args.max_tokens)
    cases = layouts(counts, prompts)
    pools = {name: BufferPool() for name in cases}
    times: dict[str, list[float]] = {name: [] for name in cases}
    sizes = {}
    for name, opts in cases.items():  # warm each pool, and check each layout once
        out = collate_routes(routes, counts, memory=Memory(buffers=pools[name], workers=args.workers), **opts)
        check(name, out, routes, counts, prompts, opts)
        sizes[name] = out["rollout_expert_indices"].nbytes
        del out
    for _ in range(args.rounds):  # interleaved: every layout once per round
        for name, opts in cases.items():
            t0 = time.perf_counter()
            out = collate_routes(routes, counts, memory=Memory(buffers=pools[name], workers=args.workers), **opts)
            times[name].append(time.perf_counter() - t0)
            del out
    real = sum(counts) * L * K
    print(
        f"{args.batch} trajectories, {sum(counts)} tokens (longest {max(counts)}), {L} layers x top-{K} uint8, "
        f"torch {torch.__version__}, {args.rounds} interleaved rounds, recycled buffers"
    )
    print(f"{'layout':<20} {'routes MB':>10} {'median ms':>10} {'min ms':>8} {'GB/s routes':>12}")
    for name in cases:
        med, lo = statistics.median(times[name]), min(times[name])
        print(
            f"{name:<20} {sizes[name] / 1e6:>10.1f} {med * 1e3:>10.1f} {lo * 1e3:>8.1f} {sizes[name] / med / 1e9:>12.2f}"
        )
    print(f"(captured route bytes: {real / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
