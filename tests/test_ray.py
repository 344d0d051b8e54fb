"""torch_r3.ray on a real local Ray cluster: rollout actors put, trainer actors fetch and collate their own.

One module-scoped cluster (Ray's start-up dominates on 2 cores) serves every
cluster test; the input checks at the top need no cluster.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from torch_r3 import Memory, Padded

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install 'torch_r3[ray]'")

import torch_r3
from tests.local_ray import start_local_ray
from tests.samples import route_samples, router_routes
from torch_r3 import R3Collator
from torch_r3.ray import RefFetch, TrajectoryRef, put_trajectory, route_dtypes, token_counts

ROOT = Path(__file__).resolve().parents[1]
L, K, EXPERTS = 6, 2, 16


def sample(i: int) -> dict:
    """Trajectory `i`, seeded by `i`, with reward `i`."""
    (one,) = route_samples(
        100 + i,
        n=1,
        min_tokens=2,
        max_tokens=19,
        captured=lambda _, n: n - 1 if i % 3 else n,  # some trajectories end in an uncaptured token
        num_layers=L,
        topk=K,
        num_experts=EXPERTS,
        dtypes=(np.int16 if i == 5 else np.uint8,),  # one wide sample widens the global batch
        token_ids=(0, 1000),
        extras=("loss_mask",),
    )
    return {**one, "reward": float(i)}


# --------------------------------------------------------------------------
# Input checks (no cluster)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"routes": np.zeros((2, L, K), np.int64)}, ValueError, "canonical dtype"),
        ({"routes": np.zeros((2, L), np.uint8)}, ValueError, "[rows, layers > 0, topk > 0]"),
        ({"routes": [[1, 2]]}, TypeError, "NumPy array"),
        ({"routes": np.zeros((9, L, K), np.uint8)}, ValueError, "9 route rows for 3 tokens"),
        ({"input_ids": np.zeros(3, np.float32)}, ValueError, "integer token ids"),
        ({"input_ids": [1, 2.5, 3]}, ValueError, "integer token ids"),  # never cast to int
    ],
)
def test_put_trajectory_refuses_what_would_not_collate_before_putting(change, error, words):
    s = {"input_ids": [1, 2, 3], "routes": np.zeros((2, L, K), np.uint8), **change}
    with pytest.raises(error, match=re.escape(words)):
        put_trajectory(s)  # no cluster running: a call that reached ray.put would fail differently


def test_ref_fetch_and_metadata_refuse_anything_but_trajectory_refs():
    with pytest.raises(TypeError, match=r"refs\[1\]: expected a TrajectoryRef"):
        RefFetch([TrajectoryRef(None, 3, 2, L, K, "uint8"), "ref"])
    with pytest.raises(TypeError, match="sequence of TrajectoryRef"):
        token_counts("abc")


def test_a_trainer_holds_no_microbatch_buffers_once_its_loop_has_dropped_them():
    # What bounds a trainer's memory to two micro-batches: the copy threads must not keep
    # the last call's rows (views of the batch) alive while they wait for the next call.
    from torch_r3 import ShardCollator

    rng = np.random.default_rng(0)
    store = [
        {"input_ids": np.arange(n), "routes": router_routes(rng, n, 58, 8, num_experts=255)}
        for n in (6000, 1000, 5000, 2000)
    ]
    shard = ShardCollator(
        lambda idx: [store[i] for i in idx],
        [[0, 1], [2, 3]],
        layout=Padded(seq_len=6000),
        memory=Memory(workers=2),
        pad_token_id=0,
    )
    for batch in shard:
        assert batch["rollout_expert_indices"].numel() > 4 << 20  # large enough for the copy threads
        del batch
    assert shard.collator.buffers.stats()["live_bytes"] == 0


# --------------------------------------------------------------------------
# One real local cluster for the rest
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    # Workers inherit this environment: the checkout's torch_r3 (and this test module's actors) come first.
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_agent_register_timeout_ms")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        start_local_ray(ray, num_cpus=2, object_store_memory=200 * 2**20)
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@ray.remote(num_cpus=0)
class Rollout:
    def generate(self, indices):
        return [put_trajectory(sample(i)) for i in indices]


@ray.remote(num_cpus=0)
class Trainer:
    def torch_r3_file(self):
        return torch_r3.__file__

    def collate(self, refs, microbatches, seq_len, dtype, layers, prefetch):
        from torch_r3 import ShardCollator

        shard = ShardCollator(
            RefFetch(refs),
            microbatches,
            layout=Padded(seq_len=seq_len),
            dtype=dtype,
            keep_layers=layers,
            prefetch=prefetch,  # ray.get from ShardCollator's helper thread
            pad_keys={"loss_mask": 0},
            filler="balanced",
            num_experts=EXPERTS,
            pad_token_id=0,
        )
        return [{k: v.numpy().copy() for k, v in batch.items()} for batch in shard]

    def fetch(self, refs, indices):
        got = RefFetch(refs)(indices)
        return [(s["routes"].flags.writeable, s["routes"].flags.owndata) for s in got]

    def fetch_error(self, refs, indices):
        try:
            RefFetch(refs)(indices)
        except (KeyError, TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return None


@pytest.fixture(scope="module")
def step(cluster):
    """Two rollout actors put 10 trajectories; the driver, as the controller, receives only their refs."""
    rollouts = [Rollout.remote(), Rollout.remote()]
    parts = ray.get([rollouts[0].generate.remote(list(range(5))), rollouts[1].generate.remote(list(range(5, 10)))])
    refs = parts[0] + parts[1]
    return rollouts, refs


@pytest.mark.slow
def test_ray_workers_import_this_checkouts_torch_r3(step):
    trainer = Trainer.remote()
    assert ray.get(trainer.torch_r3_file.remote()) == torch_r3.__file__


@pytest.mark.slow
def test_the_controller_receives_metadata_not_route_bytes(step):
    _, refs = step
    samples = [sample(i) for i in range(10)]
    assert token_counts(refs) == [len(s["input_ids"]) for s in samples]
    assert route_dtypes(refs) == [s["routes"].dtype for s in samples]
    assert [r.route_bytes for r in refs] == [s["routes"].nbytes for s in samples]
    for r in refs:
        # A ref's pickle carries no route bytes: it stays small whatever the trajectory's size.
        assert len(ray.cloudpickle.dumps(r)) < 1024
        assert len(pickle.dumps(r.ref)) < 256


@pytest.mark.slow
def test_dp2_pp2_trainer_actors_collate_their_microbatches_identical_to_the_global_batch(step):
    from torch_r3 import global_geometry, plan_microbatches

    _, refs = step
    counts = token_counts(refs)
    layout = global_geometry(counts, route_dtypes(refs), filler="balanced", num_experts=EXPERTS)
    plan = plan_microbatches(counts, dp_size=2, micro_batch_size=2)
    stages = [[0, 1, 2], [3, 4, 5]]
    trainers = {(dp, pp): Trainer.remote() for dp in range(2) for pp in range(2)}
    calls = {
        (dp, pp): t.collate.remote(
            {i: refs[i] for mb in plan[dp] for i in mb}, plan[dp], layout.seq_len, layout.dtype, stages[pp], pp == 1
        )
        for (dp, pp), t in trainers.items()
    }
    # The reference: one global batch of all samples, collated in this process from the same inputs.
    opts = {"pad_token_id": 0, "pad_keys": {"loss_mask": 0}, "filler": "balanced", "num_experts": EXPERTS}
    full = {k: v.numpy() for k, v in R3Collator(**opts)([sample(i) for i in range(10)]).items()}
    assert full["rollout_expert_indices"].dtype == np.int16  # sample 5 widened the whole batch
    checked = 0
    for (dp, pp), call in calls.items():
        batches = ray.get(call)
        assert len(batches) == len(plan[dp])
        for mb, got in zip(plan[dp], batches):
            want = {k: v[mb] for k, v in full.items()}
            want["rollout_expert_indices"] = want["rollout_expert_indices"][:, :, stages[pp]]
            assert set(got) == set(want)
            for key, expected in want.items():
                assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
                assert np.array_equal(got[key], expected), (dp, pp, mb, key)
            checked += 1
    assert checked == 2 * sum(len(p) for p in plan)


@pytest.mark.slow
def test_fetch_maps_the_object_store_without_a_copy(step):
    _, refs = step
    flags = ray.get(Trainer.remote().fetch.remote(refs, [0, 5, 7]))
    assert flags == [(False, False)] * 3  # read-only views of the store, not private copies


@pytest.mark.slow
def test_fetch_refuses_an_object_that_differs_from_its_planned_metadata(step):
    _, refs = step
    trainer = Trainer.remote()
    lying = list(refs)
    lying[3] = dataclasses.replace(refs[3], num_tokens=refs[3].num_tokens + 1)
    assert "sample 3" in ray.get(trainer.fetch_error.remote(lying, [3]))
    lying[4] = dataclasses.replace(refs[4], dtype="int16" if refs[4].dtype == "uint8" else "uint8")
    message = ray.get(trainer.fetch_error.remote(lying, [4]))
    assert message.startswith("ValueError") and "sample 4" in message and "planned" in message
    assert "KeyError" in ray.get(trainer.fetch_error.remote({0: refs[0]}, [1]))


@pytest.mark.slow
def test_the_ray_cluster_example_runs_and_matches_the_global_batch(cluster, capsys):
    spec = importlib.util.spec_from_file_location("ray_cluster_example", ROOT / "examples" / "ray_cluster.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    try:
        spec.loader.exec_module(example)
        ray.cloudpickle.register_pickle_by_value(example)  # its actors travel by value, as from a script
        assert example.main() == 0
    finally:
        sys.modules.pop(spec.name, None)
    assert "each identical to its rows of the global batch" in capsys.readouterr().out


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("cluster_bench", ROOT / "benchmarks" / "cluster.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    return bench


def test_the_cluster_benchmarks_check_tells_a_wrong_microbatch_from_the_global_batchs_rows():
    # What the benchmark's verification rests on, without a cluster: the trainers' ShardCollator
    # micro-batches hash like the reference's slices, and one changed byte, dtype or layer does not.
    import torch

    from torch_r3 import ShardCollator, global_geometry, plan_microbatches

    bench = _load_benchmark()
    cfg = bench.SMALL
    samples = [bench.make_trajectory(i, cfg) for i in range(cfg.trajectories)]
    counts = [len(s["input_ids"]) for s in samples]
    plan = plan_microbatches(counts, dp_size=cfg.dp, micro_batch_size=cfg.micro_batch_size)
    layout = global_geometry(counts, [s["routes"].dtype for s in samples])
    ref = bench.reference_digests(cfg, plan)
    for dp in range(cfg.dp):
        for pp in range(cfg.pp):
            layers = bench.stage_layers(cfg, pp)
            shard = ShardCollator(
                lambda idx: [samples[i] for i in idx],
                plan[dp],
                layout=Padded(seq_len=layout.seq_len),
                dtype=layout.dtype,
                keep_layers=layers,
                pad_token_id=0,
            )
            assert [bench.digest(b) for b in shard] == ref["stage"][dp][pp]
    batch = next(
        iter(
            ShardCollator(
                lambda idx: [samples[i] for i in idx], plan[0], layout=Padded(seq_len=layout.seq_len), pad_token_id=0
            )
        )
    )
    good = bench.digest(batch)
    assert good == ref["all"][0][0][0]
    changed = dict(batch, rollout_expert_indices=batch["rollout_expert_indices"].clone())
    changed["rollout_expert_indices"].view(-1)[-1] ^= 1
    widened = dict(batch, rollout_expert_indices=batch["rollout_expert_indices"].to(torch.int16))
    assert bench.digest(changed) != good and bench.digest(widened) != good
    assert bench.digest(batch, layers=[0, 1]) != bench.digest(batch, layers=[1, 0])
