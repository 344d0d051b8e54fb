"""Routes at cluster scale on a local Ray cluster: controller path vs refs-only per-rank collation.

One run, the same trajectories, side by side:

1. `controller`: the controller fetches every trajectory, collates the global
   padded batch (`R3Collator`), gathers each DP rank's rows into a shard, puts
   the shard into the object store (zero-copy NumPy) and every trainer of that
   DP group maps it and walks its micro-batches as slices. This is the shape
   of today's RL trainers (with their best transport, zero-copy shards).
2. `refs`: the controller receives only `torch_r3.ray.TrajectoryRef`s from the
   rollout actors, plans micro-batches from token counts (`plan_microbatches`,
   `global_layout`) and sends each trainer the refs of its DP rank's
   trajectories; each trainer collates its own micro-batches with
   `ShardCollator(RefFetch(refs), ...)` at the global `T` and dtype.
3. `refs, stage layers`: the same, each pipeline stage collating only its layers.

DeepSeek-V3-proportioned trajectories (58 MoE layers x top-8, uint8, 464 B per
token), DP 2 x PP 2 trainer actors and 4 rollout actors, sized for 2 cores.
Measured per variant: bytes through the controller (route or token bytes it
reads or writes, plus the pickled metadata it receives and sends), wall time
per step (from the controller asking the rollouts for their trajectories to
the last trainer done with its last micro-batch; a trainer touches every page
of each micro-batch, the least a host-to-device copy would do), and peak
memory growth per process (VmHWM after the step minus VmRSS before it, the
high-water mark reset through `/proc/self/clear_refs`). Fresh controller and
trainer actors per variant.

After the timed steps, each variant runs one verification step: every trainer
hashes every micro-batch (each key's dtype, shape and bytes), and the driver
compares them with the same rows (and layers) sliced from one global
`collate_routes` batch. A mismatch fails the run.

Usage:
    PYTHONPATH=. python benchmarks/cluster.py [--json out.json] [--steps 2] [--small]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import ray
import ray.cloudpickle
import torch

import torch_r3
from torch_r3 import R3Collator
from torch_r3.ray import RefFetch, TrajectoryRef, put_trajectory, route_dtypes, token_counts

KEYS = ("input_ids", "attention_mask", "rollout_expert_indices", "router_padding_mask")
PAGE = 4096


@dataclasses.dataclass(frozen=True)
class Config:
    trajectories: int = 192
    rollouts: int = 4
    dp: int = 2
    pp: int = 2
    micro_batch_size: int = 8
    layers: int = 58  # DeepSeek-V3: 61 layers, the first 3 dense
    topk: int = 8
    prompt: tuple[int, int] = (128, 1024)
    response: tuple[int, int] = (1, 6144)
    steps: int = 2
    seed: int = 0

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.topk  # uint8


SMALL = Config(trajectories=16, layers=6, micro_batch_size=2, prompt=(4, 32), response=(1, 64), steps=1)


# --------------------------------------------------------------------------
# Per-process measurements
# --------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; return that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def peak_growth(rss_before: int) -> int:
    return _status_kb("VmHWM") - rss_before


def _np(a: Any) -> np.ndarray:
    return a.numpy() if isinstance(a, torch.Tensor) else a


def touch(batch: dict[str, Any]) -> int:
    """Read one byte per page of every tensor: the mapping a host-to-device copy would need."""
    total = 0
    for key in KEYS:
        flat = _np(batch[key]).reshape(-1).view(np.uint8)
        total += int(flat[::PAGE].sum())
    return total


def digest(batch: dict[str, Any], layers: list[int] | None = None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for key in KEYS:
        a = _np(batch[key])
        if key == "rollout_expert_indices" and layers is not None:
            a = np.ascontiguousarray(a[:, :, layers])
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


def pickled_bytes(obj: Any) -> int:
    return len(ray.cloudpickle.dumps(obj))


# --------------------------------------------------------------------------
# The trajectories (generated once, on the rollout actors)
# --------------------------------------------------------------------------


def make_trajectory(i: int, cfg: Config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((cfg.seed, i))
    n = int(rng.integers(*cfg.prompt)) + int(rng.integers(*cfg.response))
    # The last token was sampled, never fed back through the routers: no route for it.
    routes = rng.integers(0, 256, size=(n - 1, cfg.layers, cfg.topk), dtype=np.uint8)
    return {"input_ids": rng.integers(0, 128_000, size=n, dtype=np.int64), "routes": routes}


@ray.remote(num_cpus=0)
class Rollout:
    def __init__(self, cfg: Config, indices: list[int]) -> None:
        self.refs = [(i, put_trajectory(make_trajectory(i, cfg))) for i in indices]

    def trajectories(self) -> list[tuple[int, TrajectoryRef]]:
        return self.refs


# --------------------------------------------------------------------------
# Trainers: one per (DP rank, PP stage)
# --------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, dp_rank: int, stage: int, cfg: Config) -> None:
        self.dp_rank, self.stage, self.cfg = dp_rank, stage, cfg
        per_stage = -(-cfg.layers // cfg.pp)
        self.stage_layers = list(range(stage * per_stage, min((stage + 1) * per_stage, cfg.layers)))
        self.collator = None

    def torch_r3_path(self) -> str:
        return os.path.dirname(torch_r3.__file__)

    def start(self) -> None:
        self.rss = reset_peak()

    def peak(self) -> int:
        return peak_growth(self.rss)

    def refs_step(self, refs: dict[int, TrajectoryRef], microbatches, seq_len, dtype, stage_only: bool, verify: bool):
        from torch_r3 import ShardCollator

        layers = self.stage_layers if stage_only else None
        shards = ShardCollator(RefFetch(refs), microbatches, seq_len=seq_len, dtype=dtype, layers=layers)
        out = []
        for batch in shards:
            out.append(digest(batch) if verify else touch(batch))
            del batch
        return out

    def shard_step(self, shard: dict[str, np.ndarray], bounds: list[int], verify: bool):
        # `shard` arrived as a top-level argument: Ray resolved it, mapped read-only from the store.
        out = []
        for lo, hi in itertools.pairwise(bounds):
            batch = {k: shard[k][lo:hi] for k in KEYS}
            out.append(digest(batch) if verify else touch(batch))
        return out


# --------------------------------------------------------------------------
# The controller: one fresh actor per variant
# --------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class Controller:
    def __init__(self, cfg: Config, rollouts, trainers) -> None:
        self.cfg, self.rollouts, self.trainers = cfg, rollouts, trainers  # trainers[dp][pp]

    def _trajectories(self) -> tuple[list[TrajectoryRef], int]:
        parts = ray.get([r.trajectories.remote() for r in self.rollouts])
        metas = sorted((pair for part in parts for pair in part), key=lambda p: p[0])
        return [m for _, m in metas], sum(pickled_bytes(p) for p in parts)

    def _plan(self, metas: list[TrajectoryRef]):
        counts = token_counts(metas)
        plan = torch_r3.plan_microbatches(counts, dp_size=self.cfg.dp, micro_batch_size=self.cfg.micro_batch_size)
        layout = torch_r3.global_layout(counts, route_dtypes(metas))
        return plan, layout

    def step(self, variant: str, verify: bool) -> dict[str, Any]:
        rss = reset_peak()
        start = time.perf_counter()
        metas, through = self._trajectories()
        plan, layout = self._plan(metas)
        if variant == "controller":
            results, moved = self._controller_path(metas, plan, verify)
        else:
            results, moved = self._refs_path(metas, plan, layout, variant == "refs_stage", verify)
        wall = time.perf_counter() - start
        return {
            "wall_s": wall,
            "through_controller": through + moved,
            "controller_peak_growth": peak_growth(rss),
            "results": results,
            "plan": plan,
            "seq_len": layout.seq_len,
        }

    def _refs_path(self, metas, plan, layout, stage_only: bool, verify: bool):
        moved, calls = 0, []
        for dp, stages in enumerate(self.trainers):
            refs = {i: metas[i] for mb in plan[dp] for i in mb}
            args = (refs, plan[dp], layout.seq_len, layout.dtype)
            moved += pickled_bytes(args) * len(stages)
            calls.append([t.refs_step.remote(*args, stage_only, verify) for t in stages])
        return [ray.get(c) for c in calls], moved

    def _controller_path(self, metas, plan, verify: bool):
        samples = ray.get([m.ref for m in metas])
        moved = sum(a.nbytes for s in samples for a in s.values())
        batch = R3Collator(pad_token_id=0)(samples)
        del samples
        calls = []
        for dp, stages in enumerate(self.trainers):
            rows = np.array([i for mb in plan[dp] for i in mb], dtype=np.int64)
            shard = {k: batch[k].numpy()[rows] for k in KEYS}
            moved += sum(a.nbytes for a in shard.values())
            ref = ray.put(shard)
            del shard
            bounds = np.cumsum([0] + [len(mb) for mb in plan[dp]]).tolist()
            moved += pickled_bytes((ref, bounds)) * len(stages)
            calls.append([t.shard_step.remote(ref, bounds, verify) for t in stages])
        del batch
        return [ray.get(c) for c in calls], moved


# --------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------

VARIANTS = {
    "controller": "controller collates, ships zero-copy shards",
    "refs": "refs only, each trainer collates its micro-batches",
    "refs_stage": "same, stage layers only",
}


def init_ray(object_store_bytes: int) -> None:
    # A loaded 2-core machine can miss Ray's 30 s agent start-up window; wait longer, retry once.
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
    for attempt in (1, 2):
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=object_store_bytes,
            )
            return
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise


def run_variant(variant: str, cfg: Config, rollouts) -> dict[str, Any]:
    trainers = [[Trainer.remote(dp, pp, cfg) for pp in range(cfg.pp)] for dp in range(cfg.dp)]
    flat = [t for stages in trainers for t in stages]
    paths = set(ray.get([t.torch_r3_path.remote() for t in flat]))
    if paths != {os.path.dirname(torch_r3.__file__)}:
        raise RuntimeError(f"trainer actors import torch_r3 from {paths}, not {os.path.dirname(torch_r3.__file__)}")
    controller = Controller.remote(cfg, rollouts, trainers)
    ray.get(controller.step.remote(variant, False))  # warm-up: imports, recycled buffers, first page faults
    walls, through, ctrl_peak, trainer_peaks = [], [], [], [0] * len(flat)
    for _ in range(cfg.steps):
        ray.get([t.start.remote() for t in flat])
        out = ray.get(controller.step.remote(variant, False))
        peaks = ray.get([t.peak.remote() for t in flat])
        trainer_peaks = [max(a, b) for a, b in zip(trainer_peaks, peaks)]
        walls.append(out["wall_s"])
        through.append(out["through_controller"])
        ctrl_peak.append(out["controller_peak_growth"])
    check = ray.get(controller.step.remote(variant, True))
    for actor in [controller, *flat]:
        ray.kill(actor)
    return {
        "variant": variant,
        "label": VARIANTS[variant],
        "wall_s": statistics.median(walls),
        "through_controller_bytes": max(through),
        "controller_peak_growth_bytes": max(ctrl_peak),
        "trainer_peak_growth_bytes": trainer_peaks,
        "digests": check["results"],
        "plan": check["plan"],
    }


def reference_digests(cfg: Config, plan, layers_of_stage) -> dict[str, list]:
    """Every micro-batch's digest, sliced from one global batch collated here."""
    samples = [make_trajectory(i, cfg) for i in range(cfg.trajectories)]
    batch = {k: v.numpy() for k, v in R3Collator(pad_token_id=0)(samples).items()}
    out: dict[str, list] = {"all": [], "stage": []}
    for dp in range(cfg.dp):
        mbs = [{k: batch[k][np.array(mb)] for k in KEYS} for mb in plan[dp]]
        out["all"].append([[digest(mb) for mb in mbs] for _ in range(cfg.pp)])
        out["stage"].append([[digest(mb, layers_of_stage(pp)) for mb in mbs] for pp in range(cfg.pp)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--small", action="store_true", help="a tiny configuration (a smoke test, not a measurement)")
    args = parser.parse_args(argv)
    cfg = SMALL if args.small else Config()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    init_ray(object_store_bytes=2 * 2**30 if not args.small else 256 * 2**20)
    try:
        per = -(-cfg.trajectories // cfg.rollouts)
        rollouts = [
            Rollout.remote(cfg, list(range(r * per, min((r + 1) * per, cfg.trajectories)))) for r in range(cfg.rollouts)
        ]
        metas = [m for part in ray.get([r.trajectories.remote() for r in rollouts]) for _, m in part]
        route_bytes = sum(m.route_bytes for m in metas)
        rows = [run_variant(v, cfg, rollouts) for v in VARIANTS]
    finally:
        ray.shutdown()
    per_stage = -(-cfg.layers // cfg.pp)
    ref = reference_digests(
        cfg, rows[0]["plan"], lambda pp: list(range(pp * per_stage, min((pp + 1) * per_stage, cfg.layers)))
    )
    checked = 0
    for row in rows:
        want = ref["stage" if row["variant"] == "refs_stage" else "all"]
        if row["digests"] != want or row["plan"] != rows[0]["plan"]:
            print(f"MISMATCH: {row['variant']} micro-batches differ from the global batch", file=sys.stderr)
            return 1
        checked += sum(len(stage) for dp in want for stage in dp)
    report(cfg, rows, route_bytes, checked, args.json)
    return 0


def report(cfg: Config, rows, route_bytes: int, checked: int, json_path: str | None) -> None:
    mb = 1e6
    print(
        f"{cfg.trajectories} trajectories, {cfg.layers} layers x top-{cfg.topk} uint8 ({cfg.bytes_per_token} B/token), "
        f"{route_bytes / mb:.0f} MB of routes; DP {cfg.dp} x PP {cfg.pp}, micro-batches of {cfg.micro_batch_size}, "
        f"{cfg.rollouts} rollout actors; median of {cfg.steps} step(s)"
    )
    print("| variant | wall/step | through controller | controller peak | each trainer peak |")
    print("|---|---|---|---|---|")
    for r in rows:
        through = r["through_controller_bytes"]
        shown = f"{through / mb:.0f} MB" if through > mb else f"{through / 1e3:.1f} kB"
        trainers = r["trainer_peak_growth_bytes"]
        print(
            f"| {r['label']} | {r['wall_s']:.2f} s | {shown} ({100 * through / route_bytes:.3g}% of routes) | "
            f"+{r['controller_peak_growth_bytes'] / mb:.0f} MB | "
            f"+{min(trainers) / mb:.0f}..{max(trainers) / mb:.0f} MB |"
        )
    print(f"{checked} micro-batches bit-identical to slicing one global collate_routes batch")
    if json_path:
        slim = [{k: v for k, v in r.items() if k not in ("digests", "plan")} for r in rows]
        with open(json_path, "w") as f:
            json.dump(
                {"config": dataclasses.asdict(cfg), "route_bytes": route_bytes, "checked": checked, "rows": slim},
                f,
                indent=2,
            )


if __name__ == "__main__":
    sys.exit(main())
