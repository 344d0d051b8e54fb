"""torch_r3.distributed in two spawned gloo processes: each rank gets exactly its trajectories, unpadded.

One spawn runs every scenario (process start-up dominates): a real scatter of
mixed-dtype trajectories whose arrivals are compared byte for byte with the
source's samples, then hand-crafted malformed messages that the receiver must
refuse before allocating. Results go to one JSON file per rank.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.samples import route_samples

pytestmark = pytest.mark.slow

L, K = 6, 4
PLAN = [[[0, 3], [5]], [[1, 2], [4, 6]]]  # rank 0 keeps 0, 3, 5; rank 1 gets 1, 2, 4, 6
EXPERTS = 256
COLLATE = {"pad_token_id": 0, "pad_keys": {"loss_mask": 0}, "filler": "balanced", "num_experts": EXPERTS}


def _samples() -> list[dict]:
    samples = route_samples(
        7,
        [5, 9, 3, 12, 7, 1, 4],
        captured=lambda i, n: max(n - i % 3, 0),  # some trajectories end in uncaptured tokens
        num_layers=L,
        topk=K,
        num_experts=200,
        dtypes=(np.uint8, np.uint8, np.int16, np.uint8, np.int16, np.uint8, np.uint8),  # rank 1 gets both dtypes
        token_ids=(0, 50_000),
    )
    for i, sample in enumerate(samples):
        sample["loss_mask"] = (np.arange(len(sample["input_ids"])) % 2).astype(np.float32)
        sample["reward"] = float(i) / 2
    return samples


def _crafted(case: str) -> list[torch.Tensor]:
    """The messages a misbehaving source sends, up to the one the receiver must refuse."""
    from torch_r3.distributed import DEFAULT_MAX_BYTES, MAX_NDIM

    # The wire header, written out from the protocol rather than imported from it:
    # magic "R3_SHARD", version 1, global samples, micro-batches, samples, keys, schema bytes, payload bytes.
    header = [0x52335F5348415244, 1, 2, 1, 1, 1, 0, 0]
    if case == "too_large":
        return [torch.tensor(header[:7] + [DEFAULT_MAX_BYTES + 1])]
    if case == "huge_table":  # no payload, but a shape table of 2**24 samples x 256 keys (200 GB)
        return [torch.tensor([header[0], 1, 2**24, 1, 2**24, 256, 0, 0])]
    if case == "bad_magic":
        return [torch.tensor([123] + header[1:])]
    schema = torch.frombuffer(bytearray(json.dumps(["routes"]).encode()), dtype=torch.uint8)
    header[6] = schema.numel()
    meta = torch.tensor([[3, 1], [4, 1]])
    layout = torch.tensor([1, 1])  # one micro-batch of one sample: global index 1
    table = torch.zeros((1, 1, 2 + MAX_NDIM), dtype=torch.int64)
    table[0, 0, :5] = torch.tensor([1, 3, 4, L, K])  # uint8 [4, L, K]
    if case == "negative_dim":
        table[0, 0, 3] = -L
    header[7] = 4 * L * K + (8 if case == "wrong_payload" else 0)
    return [torch.tensor(header), schema, meta, layout, table]


CASES = ("too_large", "huge_table", "bad_magic", "negative_dim", "wrong_payload")


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch_r3.distributed import scatter_trajectories

    try:
        samples = _samples()
        shard = scatter_trajectories(samples if rank == 0 else None, PLAN if rank == 0 else None)
        got = {
            str(g): {k: [np.asarray(v).dtype.str, np.asarray(v).tolist()] for k, v in s.items()}
            for g, s in shard.samples.items()
        }
        # Each rank collates its own micro-batches at the global layout, from what it received.
        from torch_r3 import Padded, ShardCollator, global_geometry

        geometry = global_geometry(shard.token_counts, shard.route_dtypes, filler="balanced", num_experts=EXPERTS)
        local = ShardCollator(
            shard.fetch, shard.microbatches, layout=Padded(seq_len=geometry.seq_len), dtype=geometry.dtype, **COLLATE
        )
        collated = [{k: [str(v.dtype), v.tolist()] for k, v in batch.items()} for batch in local]
        result = {
            "collated": collated,
            "microbatches": shard.microbatches,
            "token_counts": shard.token_counts,
            "route_dtypes": [d.str for d in shard.route_dtypes],
            "samples": got,
            "refusals": {},
        }
        # The other direction: rank 1 holds the step and keeps its share, rank 0 receives.
        back = scatter_trajectories(samples if rank == 1 else None, PLAN[::-1] if rank == 1 else None, src=1)
        result["from_rank1"] = {
            "microbatches": back.microbatches,
            "routes": {str(g): s["routes"].tolist() for g, s in back.samples.items()},
        }
        if rank == 0:  # refused on the source, before anything is sent
            uneven = _samples()
            del uneven[4]["reward"]
            try:
                scatter_trajectories(uneven, PLAN)
            except ValueError as e:
                result["refusals"]["uneven_keys"] = str(e)
        for case in CASES:
            if rank == 0:
                for t in _crafted(case):
                    dist.send(t, dst=1)
            else:
                try:
                    scatter_trajectories(None, None)
                except ValueError as e:
                    result["refusals"][case] = str(e)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import socket

    out = tmp_path_factory.mktemp("dist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_rank_receives_exactly_its_planned_trajectories(ranks):
    for rank, r in enumerate(ranks):
        assert r["microbatches"] == PLAN[rank]
        assert sorted(map(int, r["samples"])) == sorted(i for mb in PLAN[rank] for i in mb)


def test_received_samples_are_the_sources_bytes_unpadded(ranks):
    samples = _samples()
    for g, got in ranks[1]["samples"].items():
        want = samples[int(g)]
        assert set(got) == set(want)
        routes = np.asarray(want["routes"])
        assert got["routes"] == [routes.dtype.str, routes.tolist()]  # dtype kept (int16 too), r rows, no padding
        assert got["input_ids"][1] == want["input_ids"]
        assert got["loss_mask"] == [want["loss_mask"].dtype.str, want["loss_mask"].tolist()]
        assert got["reward"][1] == want["reward"]


def test_any_rank_can_be_the_source(ranks):
    samples = _samples()
    for rank, r in enumerate(ranks):
        got = r["from_rank1"]
        assert got["microbatches"] == PLAN[::-1][rank]
        assert got["routes"] == {str(i): samples[i]["routes"].tolist() for mb in PLAN[::-1][rank] for i in mb}


def test_every_rank_gets_the_steps_metadata_for_the_global_geometry(ranks):
    samples = _samples()
    for r in ranks:
        assert r["token_counts"] == [len(s["input_ids"]) for s in samples]
        assert r["route_dtypes"] == [s["routes"].dtype.str for s in samples]


def test_each_rank_collates_its_microbatches_identical_to_the_global_batch(ranks):
    from torch_r3 import R3Collator

    full = R3Collator(**COLLATE)(_samples())  # int16: samples 2 and 4 widen the whole batch
    assert full["rollout_expert_indices"].dtype == torch.int16
    for rank, r in enumerate(ranks):
        assert len(r["collated"]) == len(PLAN[rank])
        for mb, got in zip(PLAN[rank], r["collated"]):
            want = {k: [str(v.dtype), v[mb].tolist()] for k, v in full.items()}
            assert got == want, (rank, mb)


def test_malformed_messages_are_refused_before_allocating(ranks):
    refusals = ranks[1]["refusals"]
    assert set(refusals) == set(CASES)
    assert "max_bytes" in refusals["too_large"] and "max_bytes" in refusals["huge_table"]
    assert "sample 4: keys differ from sample 0 in ['reward']" in ranks[0]["refusals"]["uneven_keys"]
    assert "not a torch_r3 shard" in refusals["bad_magic"]
    assert "invalid shape" in refusals["negative_dim"] and "sample 1" in refusals["negative_dim"]
    assert "shapes describe" in refusals["wrong_payload"]
