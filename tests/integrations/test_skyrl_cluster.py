"""`torch_r3.integrations.skyrl.cluster` on a real local Ray: SkyRL's generator output as TrajectoryRefs,
each rank's micro-batches from `ShardCollator(RefFetch(...))` bit-identical to its rows of the global batch.

Needs only Ray (SkyRL's `GeneratorOutput` is a plain dict of lists): it runs in the main environment.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_r3 import Padded

ray = pytest.importorskip("ray")

from tests.local_ray import start_local_ray
from tests.samples import router_routes
from torch_r3 import R3Collator, global_geometry, plan_microbatches


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():
        start_local_ray(ray, num_cpus=1, object_store_memory=100 * 2**20)
    yield
    ray.shutdown()


def generator_output(seed=0, n=6):
    rng = np.random.default_rng(seed)
    out = {"prompt_token_ids": [], "response_ids": [], "loss_masks": [], "rollout_expert_indices": []}
    for _ in range(n):
        p, r = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        out["prompt_token_ids"].append(rng.integers(1, 100, p).tolist())
        out["response_ids"].append(rng.integers(1, 100, r).tolist())
        out["loss_masks"].append(rng.integers(0, 2, r).tolist())
        out["rollout_expert_indices"].append(router_routes(rng, p + r - 1, 2, 2, num_experts=16))
    return out


@pytest.mark.parametrize("side", ["left", "right"])
def test_each_rank_collates_its_microbatches_identical_to_the_global_batch(local_ray, side):
    from torch_r3.integrations.skyrl import put_rollouts, shard_batches
    from torch_r3.ray import route_dtypes, token_counts

    out = generator_output()
    refs = put_rollouts(out)
    counts = token_counts(refs)
    geometry = global_geometry(counts, route_dtypes(refs))
    plan = plan_microbatches(counts, dp_size=2, max_tokens_per_microbatch=24)
    samples = [
        {"routes": routes, "input_ids": p + r, "loss_mask": [0] * len(p) + m}
        for p, r, m, routes in zip(
            out["prompt_token_ids"], out["response_ids"], out["loss_masks"], out["rollout_expert_indices"]
        )
    ]
    whole = R3Collator(layout=Padded(side=side), pad_keys={"loss_mask": 0}, pad_token_id=0)(samples)
    seen = []
    for rank, microbatches in enumerate(plan):
        mine = {i: refs[i] for mb in microbatches for i in mb}
        for mb, batch in zip(
            microbatches,
            shard_batches(
                mine,
                microbatches,
                layout=Padded(side=side, seq_len=geometry.seq_len),
                dtype=geometry.dtype,
                pad_token_id=0,
            ),
        ):
            for key in ("rollout_expert_indices", "router_padding_mask", "attention_mask", "input_ids", "loss_mask"):
                assert torch.equal(batch[key], whole[key][mb]), (rank, key)
            assert batch["prompt_length"].tolist() == [len(out["prompt_token_ids"][i]) for i in mb]
            seen.extend(mb)
    assert sorted(seen) == list(range(len(refs)))


def test_a_generator_output_without_routes_is_refused(local_ray):
    from torch_r3.integrations.skyrl import put_rollouts

    out = generator_output(n=2)
    out["rollout_expert_indices"] = None
    with pytest.raises(ValueError, match="missing 'rollout_expert_indices'"):
        put_rollouts(out)
