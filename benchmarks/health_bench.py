"""What the engine-health checks cost per token, next to what decoding the same routes costs, in the same run.

Routes are drawn like a real router's (top-k without replacement from a Zipf-skewed expert popularity,
a different ranking per layer), at model shapes of released MoE models, over one trajectory of `--tokens`
positions, plus one `--long-tokens` trajectory (32k) at the widest shape. Every case is timed once per
round, the cases interleaved, so that a busy spell on a shared machine hits all of them alike. The
figures are this thread's CPU time (`time.thread_time`: every case runs on the calling thread, the
decode included), which a loaded machine inflates far less than the wall clock (recorded too, in
`--json`); the medians and the per-round ratios are printed (say how loaded the machine was):

* `decode sglang`: SGLang's base64 int32 `routed_experts` -> the canonical array (`decode_sglang_routes`);
* `decode vllm`: vLLM's base64 `.npy` (uint8 / uint16) -> the canonical array (`decode_vllm_routes`);
* `health`: `RouteHealthCheck.check` without token ids (zero rows, constant layers), `remember_blocks=0`;
* `+ tokens`: with the token ids (adds the stale-run check), still `remember_blocks=0`;
* `default`: what the client runs by default: token ids and the replayed-rows memory, filled to its
  default bound by earlier trajectories first (the steady state of a long run: every check looks up
  and then remembers).

    PYTHONPATH=. python benchmarks/health_bench.py                  # 8k tokens x 3 shapes, 32k x 1, 7 rounds
    PYTHONPATH=. python benchmarks/health_bench.py --rounds 9 --json out.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from torch_r3.health.check import DEFAULT_REMEMBER_BLOCKS, RouteHealthCheck
from torch_r3.rollout.codec import decode_sglang_routes, decode_vllm_routes

# (name, hidden layers, experts, top-k): every hidden layer is sent (dense ones zero).
SHAPES = [
    ("Qwen3-30B-A3B", 48, 128, 8),
    ("DeepSeek-V3", 61, 256, 8),
    ("Qwen3-235B-A22B", 94, 128, 8),
]


def router_like(rng: np.random.Generator, rows: int, layers: int, experts: int, topk: int) -> np.ndarray:
    """Zipf-skewed top-k (alpha 1.2) per layer, ids distinct per row."""
    out = np.empty((rows, layers, topk), np.uint8 if experts <= 256 else np.int16)
    weights = np.log(1.0 / np.arange(1, experts + 1) ** 1.2)
    for layer in range(layers):
        keys = weights[rng.permutation(experts)] + rng.gumbel(size=(rows, experts))
        top = np.argpartition(-keys, topk - 1, axis=1)[:, :topk]
        order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1)
        out[:, layer] = np.take_along_axis(top, order, axis=1)
    return out


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def replay_round(check: RouteHealthCheck, trajectory: tuple[np.ndarray, np.ndarray]) -> object:
    routes, ids = trajectory
    return check.check(routes, trajectory="t", token_ids=ids)


def prepare(name: str, layers: int, experts: int, topk: int, tokens: int, rounds: int, seed: int) -> dict:
    """One shape's payloads and checks, and a timed callable per case (each round takes a fresh trajectory)."""
    rng = np.random.default_rng(seed)
    routes = router_like(rng, tokens, layers, experts, topk)
    ids = rng.integers(0, 150_000, tokens)
    sglang_text = base64.b64encode(routes.astype("<i4").tobytes()).decode("ascii")
    vllm_text = npy_b64(routes.astype(np.uint8) if experts <= 256 else routes.astype("<u2"))

    plain = RouteHealthCheck("count", remember_blocks=0)
    with_tokens = RouteHealthCheck("count", remember_blocks=0)
    full = RouteHealthCheck("count")
    # Fill the memory to its bound with earlier trajectories (other routes, other tokens; uniform ids
    # are enough here: only their fingerprints are kept).
    for start in range(0, 16 * DEFAULT_REMEMBER_BLOCKS, 16384):
        filler = rng.integers(0, experts, (16384, layers, topk), dtype=routes.dtype)
        full.check(filler, trajectory=f"earlier {start}", token_ids=rng.integers(0, 150_000, 16384))
    assert len(full.memory) == DEFAULT_REMEMBER_BLOCKS, len(full.memory)

    # Each round looks up against a full memory and then remembers this trajectory's blocks: a fresh
    # trajectory each time (rows shuffled, so no run repeats an earlier one), as a run sends them.
    shuffles = [rng.permutation(tokens) for _ in range(rounds + 1)]
    fresh = iter([(np.ascontiguousarray(routes[p]), ids[p]) for p in shuffles])
    cases: dict[str, Callable[[], object]] = {
        "decode sglang": lambda: decode_sglang_routes(
            sglang_text, num_layers=layers, topk=topk, num_experts=experts, max_bytes=1 << 34
        ),
        "decode vllm": lambda: decode_vllm_routes(vllm_text, num_experts=experts, max_bytes=1 << 34),
        "health": lambda: plain.check(routes, trajectory="t"),
        "+ tokens": lambda: with_tokens.check(routes, trajectory="t", token_ids=ids),
        "default": lambda: replay_round(full, next(fresh)),
    }
    for fn in cases.values():  # warm up
        fn()
    meta = {"model": name, "layers": layers, "experts": experts, "topk": topk, "tokens": tokens}
    return {"meta": meta, "cases": cases, "checks": (plain, with_tokens, full)}


def run(shapes: list[tuple[str, int, int, int, int]], rounds: int) -> list[dict]:
    """Every shape's cases, interleaved across shapes and cases, `rounds` times."""
    prepared = [prepare(*shape, rounds, seed=i) for i, shape in enumerate(shapes)]
    per_round: list[dict[str, list[float]]] = [{k: [] for k in p["cases"]} for p in prepared]
    wall: list[dict[str, list[float]]] = [{k: [] for k in p["cases"]} for p in prepared]
    loads = []
    for _ in range(rounds):
        loads.append(os.getloadavg()[0])
        for p, times, walls in zip(prepared, per_round, wall):
            for key, fn in p["cases"].items():
                t, c = time.perf_counter(), time.thread_time()
                fn()
                times[key].append(time.thread_time() - c)
                walls[key].append(time.perf_counter() - t)
    out = []
    for p, times, walls in zip(prepared, per_round, wall):
        full = p["checks"][2]
        assert full.stats.replayed_rows == 0 and full.stats.refused == 0  # healthy routes: nothing refused
        tokens = p["meta"]["tokens"]
        seconds = {k: statistics.median(v) for k, v in times.items()}
        out.append(
            {
                **p["meta"],
                "seconds": seconds,
                "us_per_token": {k: v / tokens * 1e6 for k, v in seconds.items()},
                "rounds": times,
                "wall_rounds": walls,
                "load_per_round": loads,
                # Per round, the default checks over the SGLang decode of the same round.
                "ratio_rounds": [d / s for d, s in zip(times["default"], times["decode sglang"])],
                "memory_blocks": len(full.memory),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--long-tokens", type=int, default=32768, help="the long trajectory, at the widest shape")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shapes = [(*shape, args.tokens) for shape in SHAPES]
    if args.long_tokens:
        shapes.append((*SHAPES[-1], args.long_tokens))
    rows = run([(n, la, e, k, t) for n, la, e, k, t in shapes], args.rounds)
    keys = list(rows[0]["seconds"])
    loads = rows[0]["load_per_round"]
    print(
        f"CPU time, median of {args.rounds} interleaved rounds: ms per trajectory, us per token "
        f"(load average {min(loads):.1f}..{max(loads):.1f} on {os.cpu_count()} CPUs)"
    )
    print(f"{'model':<18}{'tokens':>7}" + "".join(f"{k:>22}" for k in keys) + f"{'default/sglang':>16}")
    for r in rows:
        cells = "".join(f"{r['seconds'][k] * 1e3:>12.2f}{r['us_per_token'][k]:>8.3f}us" for k in keys)
        ratio = r["seconds"]["default"] / r["seconds"]["decode sglang"]
        print(f"{r['model']:<18}{r['tokens']:>7}{cells}{ratio:>16.2f}")
    print("per round, default checks / SGLang decode of the same round:")
    for r in rows:
        print(f"{r['model']:<18}{r['tokens']:>7}  " + " ".join(f"{x:.2f}" for x in r["ratio_rounds"]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
