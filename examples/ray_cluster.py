"""Routes at cluster scale on a local Ray cluster: the controller passes refs, each trainer collates its own.

Two rollout actors put each trajectory into Ray's object store once
(`torch_r3.ray.put_trajectory`) and return small `TrajectoryRef`s. The
controller (this script) plans micro-batches from token counts alone
(`plan_microbatches`, `global_geometry`) and hands each trainer actor, one per
(DP rank, pipeline stage), the refs of its DP rank's trajectories. Each
trainer collates its own micro-batches, only its stage's layers, with
`ShardCollator(RefFetch(refs), ...)`, at the global batch's `T` and dtype.

To show that this is the same batch, the trainers return checksums of their
micro-batches and the script compares them with the same rows of one global
batch collated here (a real trainer would not build that batch: it is the
thing this layout avoids).

Run: python examples/ray_cluster.py   (starts a 2-CPU local Ray cluster; under a minute)
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import ray

from torch_r3 import Padded, R3Collator, ShardCollator, global_geometry, plan_microbatches
from torch_r3.ray import RefFetch, put_trajectory, route_dtypes, token_counts

NUM_TRAJECTORIES, DP, PP = 24, 2, 2
LAYERS, TOPK, EXPERTS = 8, 4, 64
OPTIONS = {"pad_token_id": 0, "pad_keys": {"loss_mask": 0}, "filler": "balanced", "num_experts": EXPERTS}


def make_sample(i: int) -> dict:
    """One trajectory as a rollout produces it: tokens, a loss mask, compacted routes."""
    rng = np.random.default_rng(i)
    n = int(rng.integers(4, 40))
    return {
        "input_ids": rng.integers(1, 32_000, size=n),
        "loss_mask": (np.arange(n) >= n // 3).astype(np.float32),  # the response part
        # TOPK distinct experts per token, as a router chooses them
        "routes": rng.random((n - 1, LAYERS, EXPERTS)).argsort(-1)[..., :TOPK].astype(np.uint8),
    }


def checksum(batch: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(batch):
        a = np.ascontiguousarray(batch[key].numpy())
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    return h.hexdigest()


@ray.remote(num_cpus=0)
class Rollout:
    def generate(self, indices: list[int]) -> list:
        return [put_trajectory(make_sample(i)) for i in indices]


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, stage: int) -> None:
        per_stage = LAYERS // PP
        self.layers = list(range(stage * per_stage, (stage + 1) * per_stage))

    def train(self, refs: dict, microbatches: list, seq_len: int, dtype) -> list[str]:
        shard = ShardCollator(
            RefFetch(refs),
            microbatches,
            layout=Padded(seq_len=seq_len),
            dtype=dtype,
            keep_layers=self.layers,
            **OPTIONS,
        )
        # Here a trainer would run forward/backward with ReplayHook on each batch.
        return [checksum(batch) for batch in shard]


def main() -> int:
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")  # slow machines
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rollouts = [Rollout.remote() for _ in range(2)]
        halves = [list(range(0, NUM_TRAJECTORIES, 2)), list(range(1, NUM_TRAJECTORIES, 2))]
        refs = [None] * NUM_TRAJECTORIES
        for indices, part in zip(halves, ray.get([r.generate.remote(ix) for r, ix in zip(rollouts, halves)])):
            for i, ref in zip(indices, part):
                refs[i] = ref

        # The controller's whole job: metadata in, a plan and refs out.
        counts = token_counts(refs)
        layout = global_geometry(counts, route_dtypes(refs), filler="balanced", num_experts=EXPERTS)
        plan = plan_microbatches(counts, dp_size=DP, micro_batch_size=3)
        trainers = [[Trainer.remote(stage) for stage in range(PP)] for _ in range(DP)]
        calls = {}
        for dp in range(DP):
            mine = {i: refs[i] for mb in plan[dp] for i in mb}
            for stage in range(PP):
                calls[dp, stage] = trainers[dp][stage].train.remote(mine, plan[dp], layout.seq_len, layout.dtype)
        got = {key: ray.get(call) for key, call in calls.items()}

        # Check: the same rows and layers of one global batch.
        full = R3Collator(**OPTIONS)([make_sample(i) for i in range(NUM_TRAJECTORIES)])
        per_stage = LAYERS // PP
        matched = 0
        for (dp, stage), sums in got.items():
            for mb, s in zip(plan[dp], sums):
                want = {k: v[mb] for k, v in full.items()}
                want["rollout_expert_indices"] = want["rollout_expert_indices"][
                    :, :, stage * per_stage : (stage + 1) * per_stage
                ]
                if checksum(want) != s:
                    print(f"rank (dp {dp}, stage {stage}), micro-batch {mb}: differs from the global batch")
                    return 1
                matched += 1
        print(f"{matched} micro-batches on {DP * PP} trainers, each identical to its rows of the global batch")
        return 0
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
