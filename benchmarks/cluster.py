"""Routes at cluster scale on a local Ray cluster: controller path vs refs-only per-rank collation.

One run, the same trajectories, side by side:

1. `controller`: the controller fetches every trajectory, collates the global
   padded batch (`R3Collator`), gathers each DP rank's rows into a shard, puts
   the shard into the object store (zero-copy NumPy) and every trainer of that
   DP group maps it and walks its micro-batches as slices. This is the shape
   of today's RL trainers (with their best transport, zero-copy shards).
2. `refs`: the controller receives only `torch_r3.ray.TrajectoryRef`s from the
   rollout actors, plans micro-batches from token counts (`plan_microbatches`,
   `global_geometry`) and sends each trainer the refs of its DP rank's
   trajectories; each trainer collates its own micro-batches with
   `ShardCollator(RefFetch(refs), ...)` at the global `T` and dtype.
3. `refs, stage layers`: the same, each pipeline stage collating only its layers.

DeepSeek-V3-proportioned trajectories (58 MoE layers x top-8, uint8, 464 B per
token), DP 2 x PP 2 trainer actors and 4 rollout actors, sized for 2 cores.
Measured per variant: bytes through the controller (route or token bytes it
reads or writes, plus the pickled metadata it receives and sends), wall time
per step (from the controller asking the rollouts for their trajectories to
the last trainer done with its last micro-batch; a trainer touches every page
of each micro-batch, the least a host-to-device copy would do; median of the
timed steps after a warm-up step), and peak memory growth per process over the
first step of fresh actors (VmHWM after it minus VmRSS before it, the
high-water mark reset through `/proc/self/clear_refs`), with the part of each
trainer's RSS that is object-store pages (from `/proc/self/smaps`). Fresh
controller and trainer actors per variant; one `BufferPool` per trainer.

After the timed steps, each variant runs one verification step: every trainer
hashes every micro-batch (each key's dtype, shape and bytes), and the driver
compares them with the same rows (and layers) sliced from one global batch
collated here by `R3Collator` (the `collate_routes` kernel). A mismatch fails
the run (exit 1), whatever the timings.

One file past 500 lines on purpose: run as a script, its actor classes travel to
the Ray workers by value from `__main__`, with the helpers they use, and
nothing here is imported by the package.

Usage:
    PYTHONPATH=. python benchmarks/cluster.py [--json out.json] [--steps 2] [--small] [--check-targets]
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
from torch_r3 import BufferPool, Memory, Padded, R3Collator
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


def store_rss() -> int:
    """Bytes of Ray's object store (its `/dev/shm/plasma*` mapping) resident in this process."""
    total, in_store = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's first line: address range ... pathname
                in_store = "/plasma" in line
            elif head == "Rss:" and in_store:
                total += int(line.split()[1]) * 1024
    return total


class Meter:
    """This process's peak RSS growth since `start`, and how much of its RSS now is private or store pages."""

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.before = {f: _status_kb(f) for f in ("VmRSS", "RssAnon", "RssShmem")}
        self.before["store"] = store_rss()

    def read(self) -> dict[str, int]:
        return {
            "peak": _status_kb("VmHWM") - self.before["VmRSS"],
            "anon_now": _status_kb("RssAnon") - self.before["RssAnon"],
            "shmem_now": _status_kb("RssShmem") - self.before["RssShmem"],
            "store_now": store_rss() - self.before["store"],
        }


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
        self.stage_layers = stage_layers(cfg, stage)
        self.pool = BufferPool()  # one per trainer: later steps reuse the first step's buffers
        self.collator = None

    def torch_r3_path(self) -> str:
        return os.path.dirname(torch_r3.__file__)

    def start(self) -> None:
        self.meter = Meter()
        self.meter.start()

    def memory(self) -> dict[str, int]:
        return self.meter.read()

    def refs_step(self, refs: dict[int, TrajectoryRef], microbatches, seq_len, dtype, stage_only: bool, verify: bool):
        from torch_r3 import ShardCollator

        layers = self.stage_layers if stage_only else None
        shards = ShardCollator(
            RefFetch(refs),
            microbatches,
            layout=Padded(seq_len=seq_len),
            memory=Memory(buffers=self.pool),
            dtype=dtype,
            keep_layers=layers,
            pad_token_id=0,
        )
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
        layout = torch_r3.global_geometry(counts, route_dtypes(metas))
        return plan, layout

    def start(self) -> None:
        self.meter = Meter()
        self.meter.start()

    def memory(self) -> dict[str, int]:
        return self.meter.read()

    def step(self, variant: str, verify: bool) -> dict[str, Any]:
        start = time.perf_counter()
        metas, through = self._trajectories()
        plan, layout = self._plan(metas)
        self._last = start
        self.phases: dict[str, float] = {}
        self._lap("metadata and plan")
        if variant == "controller":
            results, moved = self._controller_path(metas, plan, verify)
        else:
            results, moved = self._refs_path(metas, plan, layout, variant == "refs_stage", verify)
        wall = time.perf_counter() - start
        return {
            "wall_s": wall,
            "phases_s": self.phases,
            "through_controller": through + moved,
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
        self._lap("send")
        results = [ray.get(c) for c in calls]
        self._lap("trainers")
        return results, moved

    def _lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name], self._last = now - self._last, now

    def _controller_path(self, metas, plan, verify: bool):
        samples = ray.get([m.ref for m in metas])
        moved = sum(a.nbytes for s in samples for a in s.values())
        self._lap("fetch")
        batch = R3Collator(pad_token_id=0)(samples)
        del samples
        self._lap("collate")
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
        self._lap("shard and put")
        results = [ray.get(c) for c in calls]
        self._lap("trainers")
        return results, moved


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
    # Memory over the first step of fresh processes: its allocations (recycled buffers, mapped pages) all count.
    # Later steps run warm; a new step's shard may land elsewhere in the store and map new pages.
    ray.get([a.start.remote() for a in [controller, *flat]])
    ray.get(controller.step.remote(variant, False))
    ctrl_mem, *trainer_mem = ray.get([a.memory.remote() for a in [controller, *flat]])
    steps = [ray.get(controller.step.remote(variant, False)) for _ in range(cfg.steps)]
    check = ray.get(controller.step.remote(variant, True))
    for actor in [controller, *flat]:
        ray.kill(actor)
    return {
        "variant": variant,
        "label": VARIANTS[variant],
        "wall_s": statistics.median(s["wall_s"] for s in steps),
        "phases_s": {k: statistics.median(s["phases_s"][k] for s in steps) for k in steps[0]["phases_s"]},
        "through_controller_bytes": max(s["through_controller"] for s in steps),
        "controller_peak_growth_bytes": ctrl_mem["peak"],
        "trainer_peak_growth_bytes": [m["peak"] for m in trainer_mem],
        "memory_detail": {"controller": ctrl_mem, "trainers": trainer_mem},
        "digests": check["results"],
        "plan": check["plan"],
        "seq_len": check["seq_len"],
    }


def reference_digests(cfg: Config, plan) -> dict[str, list]:
    """Every micro-batch's digest, sliced from one global batch collated here."""
    samples = [make_trajectory(i, cfg) for i in range(cfg.trajectories)]
    batch = {k: v.numpy() for k, v in R3Collator(pad_token_id=0)(samples).items()}
    out: dict[str, list] = {"all": [], "stage": []}
    for dp in range(cfg.dp):
        mbs = [{k: batch[k][np.array(mb)] for k in KEYS} for mb in plan[dp]]
        out["all"].append([[digest(mb) for mb in mbs] for _ in range(cfg.pp)])
        out["stage"].append([[digest(mb, stage_layers(cfg, pp)) for mb in mbs] for pp in range(cfg.pp)])
    return out


def stage_layers(cfg: Config, stage: int) -> list[int]:
    per_stage = -(-cfg.layers // cfg.pp)
    return list(range(stage * per_stage, min((stage + 1) * per_stage, cfg.layers)))


def own_inputs(cfg: Config, metas: list[TrajectoryRef], plan) -> list[int]:
    """Per trainer: the bytes of its DP rank's trajectories (routes and token ids)."""
    per_dp = [
        sum(metas[i].route_bytes + 8 * metas[i].num_tokens for mb in plan[dp] for i in mb) for dp in range(cfg.dp)
    ]
    return [per_dp[dp] for dp in range(cfg.dp) for _ in range(cfg.pp)]


def buffer_bound(cfg: Config, plan, seq_len: int, stage_only: bool) -> list[int]:
    """Per trainer: two of its largest micro-batch's output buffers (routes, masks, token ids)."""
    bounds = []
    for dp in range(cfg.dp):
        for pp in range(cfg.pp):
            layers = len(stage_layers(cfg, pp)) if stage_only else cfg.layers
            per_token = layers * cfg.topk + 1 + 8 + 8  # routes, router mask, attention mask, input ids
            bounds.append(2 * max(len(mb) for mb in plan[dp]) * seq_len * per_token)
    return bounds


def measure(cfg: Config) -> dict[str, Any]:
    """Every variant on one running Ray cluster, verified; the figures and the targets."""
    load_before = os.getloadavg()[0]
    per = -(-cfg.trajectories // cfg.rollouts)
    rollouts = [
        Rollout.remote(cfg, list(range(r * per, min((r + 1) * per, cfg.trajectories)))) for r in range(cfg.rollouts)
    ]
    try:
        metas = sorted(
            (p for part in ray.get([r.trajectories.remote() for r in rollouts]) for p in part), key=lambda p: p[0]
        )
        metas = [m for _, m in metas]
        rows = [run_variant(v, cfg, rollouts) for v in VARIANTS]
    finally:
        for r in rollouts:
            ray.kill(r)
    route_bytes = sum(m.route_bytes for m in metas)
    plan, seq_len = rows[0]["plan"], rows[0]["seq_len"]
    ref = reference_digests(cfg, plan)
    checked, mismatches = 0, []
    for row in rows:
        want = ref["stage" if row["variant"] == "refs_stage" else "all"]
        if row["digests"] != want or row["plan"] != plan:
            mismatches.append(row["variant"])
        checked += sum(len(stage) for dp in want for stage in dp)
    base = rows[0]
    targets = []
    for row in rows[1:]:
        # The inputs a trainer maps are measured (its resident store pages), beside its own trajectories' bytes.
        mapped = [m["store_now"] for m in row["memory_detail"]["trainers"]]
        bounds = [b + m for b, m in zip(buffer_bound(cfg, plan, seq_len, row["variant"] == "refs_stage"), mapped)]
        peaks = row["trainer_peak_growth_bytes"]
        targets += [
            (
                row["variant"],
                "through controller <= 1% of route bytes",
                row["through_controller_bytes"] <= route_bytes / 100,
            ),
            (row["variant"], "controller growth <= 16 MB", row["controller_peak_growth_bytes"] <= 16 * 2**20),
            (
                row["variant"],
                "each trainer <= 2 micro-batches' buffers + the store pages it maps",
                all(p <= b for p, b in zip(peaks, bounds)),
            ),
            (row["variant"], "wall <= 0.5x the controller path", row["wall_s"] <= 0.5 * base["wall_s"]),
        ]
        row["trainer_bound_bytes"] = bounds
        row["trainer_own_input_bytes"] = own_inputs(cfg, metas, plan)
    return {
        "config": dataclasses.asdict(cfg),
        "route_bytes": route_bytes,
        "seq_len": seq_len,
        "checked": checked,
        "mismatches": mismatches,
        "load_average": [load_before, os.getloadavg()[0]],
        "targets": [{"variant": v, "target": t, "met": bool(m)} for v, t, m in targets],
        "rows": [{k: v for k, v in r.items() if k not in ("digests", "plan")} for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--small", action="store_true", help="a tiny configuration (a smoke test, not a measurement)")
    parser.add_argument("--check-targets", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    cfg = SMALL if args.small else Config()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    init_ray(object_store_bytes=2 * 2**30 if not args.small else 256 * 2**20)
    try:
        result = measure(cfg)
    finally:
        ray.shutdown()
    print(report(cfg, result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if result["mismatches"]:
        print(f"MISMATCH: {result['mismatches']} micro-batches differ from the global batch", file=sys.stderr)
        return 1
    return 1 if args.check_targets and not all(t["met"] for t in result["targets"]) else 0


def _size(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if abs(n) >= 1e6 else f"{n / 1e3:.1f} kB"


def report(cfg: Config, result: dict[str, Any]) -> str:
    route_bytes = result["route_bytes"]
    lines = [
        (
            f"{cfg.trajectories} trajectories, {cfg.layers} layers x top-{cfg.topk} uint8 ({cfg.bytes_per_token} B/token), "
            f"{_size(route_bytes)} of routes, T = {result['seq_len']}; DP {cfg.dp} x PP {cfg.pp}, "
            f"micro-batches of {cfg.micro_batch_size}, {cfg.rollouts} rollout actors; median of {cfg.steps} step(s)"
        ),
        "",
        "| variant | wall/step | through controller | controller peak | each trainer peak | of which store pages |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        through, peaks = r["through_controller_bytes"], r["trainer_peak_growth_bytes"]
        store = [m["store_now"] for m in r["memory_detail"]["trainers"]]
        lines.append(
            f"| {r['label']} | {r['wall_s']:.2f} s | {_size(through)} ({100 * through / route_bytes:.2g}% of routes) | "
            f"+{_size(r['controller_peak_growth_bytes'])} | +{_size(min(peaks))} to +{_size(max(peaks))} | "
            f"{_size(min(store))} to {_size(max(store))} |"
        )
    own = result["rows"][1]["trainer_own_input_bytes"]
    lines.append("")
    lines.append(f"each trainer's own trajectories (routes and token ids): {_size(min(own))} to {_size(max(own))}")
    for r in result["rows"]:
        lines.append(f"{r['variant']:>10}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases_s"].items()))
    lo, hi = result["load_average"]
    lines.append(f"1-minute load average {lo:.1f} before, {hi:.1f} after (on {os.cpu_count()} CPUs)")
    lines.append("")
    for t in result["targets"]:
        lines.append(f"{'ok    ' if t['met'] else 'MISSED'} {t['variant']}: {t['target']}")
    ok = "bit-identical" if not result["mismatches"] else f"NOT identical in {result['mismatches']}"
    lines.append(f"{result['checked']} micro-batches {ok} to slicing one global collate_routes batch")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
