#!/usr/bin/env python
"""The host-to-GPU path of a training step, on one CUDA device (sized for under 5 minutes).

    python benchmarks/gpu_check.py                 # default shape, then the production preset's per-rank share
    python benchmarks/gpu_check.py --ranks 16 --json gpu.json

For each shape it collates with `torch_r3.collate_routes(..., pin_memory=True,
buffers=pool)` (pinned, recycled outputs from one `torch_r3.BufferPool`) and
reports:

- collation alone: time per batch and bytes/s;
- the host-to-device copy alone (`non_blocking=True` on a side stream): time
  per batch and bytes/s, beside the card's copy bandwidth (a pinned tensor of
  the same size copied with `Tensor.copy_`);
- the pipeline a training loop runs: batch N's copy in flight while batch N+1
  is collated, with batch N's host buffers held until its copy has finished
  (so the pool never hands out memory the DMA engine still reads); per batch,
  and how much of the shorter stage it hid (100% = perfect overlap);
- the pool's counters: buffers mapped (and pinned) once, then only reused.

The last device batch is compared with a fresh CPU collation of the same input.
Without CUDA it prints why and exits 0, so CI runs it everywhere and it only
measures where a GPU exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from typing import Any

import torch

from torch_r3 import BufferPool, Memory, collate_routes
from torch_r3.bench import PRESETS, BenchConfig, InsufficientMemoryError, check_memory, make_batch
from torch_r3.bench.config import max_padded_bytes
from torch_r3.bench.units import format_bytes, format_gib, format_rate

# Host memory of one shape besides its input: two pinned batches in the pool,
# the fresh CPU collation of the check and the device batch copied back.
_HOST_BATCHES = 4


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def card_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Host-to-device bytes/s of a plain pinned tensor of `nbytes` (the card's copy bandwidth)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _sync_time(lambda: dst.copy_(src, non_blocking=True))  # warm-up
    best = min(_sync_time(lambda: dst.copy_(src, non_blocking=True)) for _ in range(repeats))
    return nbytes / best


def _to_device(host: dict[str, torch.Tensor], device: torch.device, stream: torch.cuda.Stream):
    with torch.cuda.stream(stream):
        dev = {k: v.to(device, non_blocking=True) for k, v in host.items()}
        done = torch.cuda.Event()
        done.record(stream)
    return dev, done


def check_shape(config: BenchConfig, device: torch.device, batches: int) -> dict[str, Any]:
    """Collation, copy and the overlapped pipeline on the batch of `config`."""
    batch = make_batch(config)
    pool = BufferPool()
    stream = torch.cuda.Stream(device)

    def collate() -> dict[str, torch.Tensor]:
        return collate_routes(
            batch.routes,
            batch.token_counts,
            memory=Memory(pin_memory=True, buffers=pool),
        )

    host = collate()  # maps (and pins) the pool's first buffers
    nbytes = sum(t.nbytes for t in host.values())
    pinned = all(t.is_pinned() for t in host.values())
    collate_s = statistics.median(_sync_time(collate) for _ in range(batches))
    copy_s = statistics.median(_sync_time(functools.partial(_to_device, host, device, stream)) for _ in range(batches))
    del host  # the pipeline below holds at most two batches, as a training loop does

    # The pipeline: collate N+1 while N's copy runs; hold N's host batch until its copy is done.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    in_flight = None
    for _ in range(batches):
        nxt = collate()
        if in_flight is not None:
            in_flight[2].synchronize()
        in_flight = (nxt, *_to_device(nxt, device, stream))
    in_flight[2].synchronize()
    pipeline_s = (time.perf_counter() - t0) / batches
    hidden = (collate_s + copy_s - pipeline_s) / min(collate_s, copy_s)

    want = collate_routes(batch.routes, batch.token_counts, memory=Memory(pin_memory=False))
    identical = all(torch.equal(in_flight[1][k].cpu(), want[k]) for k in want)
    return {
        "shape": config.label,
        "batch_bytes": nbytes,
        "outputs_pinned": pinned,
        "collate_s": collate_s,
        "collate_bytes_per_s": nbytes / collate_s,
        "copy_s": copy_s,
        "copy_bytes_per_s": nbytes / copy_s,
        "card_bytes_per_s": card_bandwidth(nbytes, device),
        "pipeline_s": pipeline_s,
        "overlap_hidden": max(0.0, min(1.0, hidden)),
        "pool": pool.stats(),
        "identical": identical,
    }


def _print(r: dict[str, Any]) -> None:
    print(f"\n{r['shape']}: {format_bytes(r['batch_bytes'])} per batch, outputs pinned: {r['outputs_pinned']}")
    print(
        f"  collate alone     {r['collate_s'] * 1e3:8.1f} ms  {format_rate(r['collate_bytes_per_s'])} "
        f"({r['collate_bytes_per_s'] / r['card_bytes_per_s']:.0%} of the card's copy bandwidth)"
    )
    print(
        f"  H2D copy alone    {r['copy_s'] * 1e3:8.1f} ms  {format_rate(r['copy_bytes_per_s'])} "
        f"({r['copy_bytes_per_s'] / r['card_bytes_per_s']:.0%} of the card's "
        f"{format_rate(r['card_bytes_per_s'])})"
    )
    print(
        f"  pipelined         {r['pipeline_s'] * 1e3:8.1f} ms per batch; {r['overlap_hidden']:.0%} of the "
        f"shorter stage hidden"
    )
    p = r["pool"]
    print(
        f"  pool              {p['misses']} buffers mapped and pinned, {p['hits']} reuses; device batch "
        f"{'identical to' if r['identical'] else 'DIFFERS from'} the CPU collation"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ranks", type=int, default=8, help="data-parallel ranks the production batch is split over (default 8)"
    )
    parser.add_argument("--batches", type=int, default=6, help="batches per measurement (default 6)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.batches < 2:
        parser.error("--ranks must be >= 1 and --batches >= 2")
    if not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device here (this check measures the host-to-GPU path)")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"gpu_check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    production = dict(PRESETS["production"])
    production["num_sequences"] = max(1, production["num_sequences"] // args.ranks)
    shapes = [BenchConfig(**PRESETS["default"], repeats=1), BenchConfig(**production, repeats=1)]
    results = []
    for i, config in enumerate(shapes):
        name = "default shape" if i == 0 else f"production preset, one rank of {args.ranks}"
        batch_bytes = max_padded_bytes(config)
        need = _HOST_BATCHES * batch_bytes + batch_bytes // 2
        try:
            check_memory(need, config.label)
        except InsufficientMemoryError as e:
            print(f"\n{name}: skipped: {e}")
            continue
        print(f"\n{name} (host memory: up to {format_gib(need)})", end="", flush=True)
        r = check_shape(config, device, args.batches)
        r["name"], r["config"] = name, dataclasses.asdict(config)
        _print(r)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "results": results},
                f,
                indent=2,
            )
    return 0 if all(r["identical"] and r["outputs_pinned"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
