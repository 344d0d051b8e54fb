"""`torch_r3.integrations.skyrl.worker`: SkyRL 0.4.0's micro-batches replayed by `torch_r3.megatron.ReplayHook`.

The routes and masks are compared with SkyRL's own alignment
(`token_metadata.align_token_metadata` / `align_packed_token_metadata`, the
functions `setup_per_microbatch_replay_forward` calls) and the model inputs with
its `remove_left_padding`; then a tiny Megatron model replays one step from
SkyRL's batch through each path. SkyRL's modules come from the installed wheel
behind bare parent packages (`frameworks.load`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integrations.frameworks import load, requires
from tests.samples import router_routes
from torch_r3 import Packed, Padded

pytestmark = [requires("skyrl"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

pytest.importorskip("megatron.core.transformer.moe.router_replay")

from _models import EXPERTS, TOPK, RouteRecorder, expected_map

LAYERS = 2


@pytest.fixture(scope="module")
def skyrl():
    return dict(
        zip(
            ("preprocess", "training_batch", "metadata", "replay", "packing", "megatron_utils"),
            load(
                "skyrl",
                "skyrl.train.dataset.preprocess",
                "skyrl.backends.skyrl_train.training_batch",
                "skyrl.backends.skyrl_train.distributed.megatron.token_metadata",
                "skyrl.backends.skyrl_train.utils.replay_utils",
                "skyrl.backends.skyrl_train.distributed.megatron.packing_utils",
                "skyrl.backends.skyrl_train.distributed.megatron.megatron_utils",
            ),
            strict=True,
        )
    )


def skyrl_batch(skyrl, seed=0, n=6, vocab=64):
    """A SkyRL `TrainingInputBatch` as `convert_to_training_input` builds it, routes collated by torch_r3."""
    from torch_r3.integrations.skyrl import install, make_router_padding_mask

    rng = np.random.default_rng(seed)
    prompts, responses, rewards, masks, routes = [], [], [], [], []
    for _ in range(n):
        p, r = int(rng.integers(2, 8)), int(rng.integers(2, 9))
        prompts.append(rng.integers(1, vocab, p).tolist())
        responses.append(rng.integers(1, vocab, r).tolist())
        rewards.append([0.0] * r)
        masks.append([1] * r)
        rows = p + r - 1 - int(rng.integers(0, 2))  # the last token, sometimes one more, uncaptured
        routes.append(router_routes(rng, rows, LAYERS, TOPK, num_experts=EXPERTS))
    with install():
        out = skyrl["preprocess"].convert_prompts_responses_to_batch_tensors(
            0, prompts, responses, rewards, masks, None, routes
        )
    return skyrl["training_batch"].TrainingInputBatch(
        {
            "sequences": out[0],
            "attention_mask": out[1],
            "rollout_expert_indices": out[6],
            "router_padding_mask": make_router_padding_mask(out[1], [len(r) for r in routes]),
        }
    )


def skyrl_layout(skyrl, attention, *, packed, align):
    """SkyRL's own TokenMetadataLayout for the alignment unit its packing_utils gives."""
    metadata = skyrl["metadata"]
    mask = attention.bool()
    lengths = mask.sum(1, dtype=torch.int32)
    if not packed:
        longest = int(lengths.max())
        return metadata.TokenMetadataLayout(mask, lengths.tolist(), longest + (-longest % align))
    padded = lengths + (-lengths % align)
    cu_padded = torch.cat((torch.zeros(1, dtype=torch.int32), padded.cumsum(0, dtype=torch.int32)))
    return metadata.TokenMetadataLayout(mask, lengths.tolist(), int(padded.sum()), padded.tolist(), cu_padded)


@pytest.mark.parametrize("packed", [False, True], ids=["right-padded", "packed"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_microbatch_routes_and_mask_equal_skyrls_alignment(skyrl, packed, tp):
    from torch_r3.integrations.skyrl import microbatch

    packing = skyrl["packing"]
    align = packing.get_packed_seq_align_size(tp, 1) if packed else packing.get_unpacked_seq_align_size(tp)
    batch = skyrl_batch(skyrl, seed=tp)
    for chunk in batch.chunk(3):
        layout_value = Packed(pad_to_multiple_of=align) if packed else Padded(side="right", pad_to_multiple_of=align)
        ours = microbatch(chunk, layout=layout_value)
        layout = skyrl_layout(skyrl, chunk["attention_mask"], packed=packed, align=align)
        filler = skyrl["replay"].replay_padding_row(TOPK, dtype=chunk["rollout_expert_indices"].dtype)
        routes = skyrl["metadata"].align_packed_token_metadata(chunk["rollout_expert_indices"], layout, filler)
        mask = skyrl["metadata"].align_token_metadata(chunk["router_padding_mask"], layout, True)
        if packed:
            routes, mask = routes[0], mask[0]
            assert torch.equal(ours["cu_seqlens_padded"], layout.cu_seqlens_padded)
            assert ours["cu_seqlens"].tolist() == [0, *np.cumsum(layout.sequence_lengths).tolist()]
        assert ours["rollout_expert_indices"].dtype == routes.dtype
        assert torch.equal(ours["rollout_expert_indices"], routes)
        assert torch.equal(ours["router_padding_mask"], mask)


def test_padded_model_inputs_equal_skyrls_remove_left_padding(skyrl, world_of_one):
    from torch_r3.integrations.skyrl import microbatch

    batch = skyrl_batch(skyrl, seed=7)
    attention = batch["attention_mask"].bool()
    positions = (attention.long().cumsum(1) - 1).clamp(min=0)
    ids, mask, _ = skyrl["megatron_utils"].remove_left_padding(batch["sequences"], attention, positions)
    ours = microbatch(batch)
    assert torch.equal(ours["input_ids"], ids)
    assert torch.equal(ours["attention_mask"].bool(), mask)


def test_a_router_mask_whose_captured_rows_are_not_a_prefix_is_refused(skyrl):
    from torch_r3.integrations.skyrl import microbatch

    batch = skyrl_batch(skyrl, seed=1, n=2)
    mask = batch["router_padding_mask"].clone()
    start = int((~batch["attention_mask"].bool()[1]).sum())
    mask[1, start] = True  # the first real token uncaptured, the next captured
    broken = dict(batch.items()) if hasattr(batch, "items") else {k: batch[k] for k in batch.keys()}
    broken["router_padding_mask"] = mask
    with pytest.raises(ValueError, match=r"router_padding_mask\[1\]: its captured tokens are not a prefix"):
        microbatch(broken)


def only_model(monkeypatch):
    """A tiny MoE GPTModel whose routers are the only ones in Megatron's process-global RouterReplay list.

    SkyRL's set-up reads that list (one model per worker process); the models of
    earlier tests in this process would be in it too.
    """
    from _models import build_model
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    torch.manual_seed(0)
    model = build_model(seq_len=64)
    own = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    monkeypatch.setattr(RouterReplay, "global_router_replay_instances", own)
    return model


def run(model, hook, microbatches, *, forward_only):
    """One ReplayHook step over SkyRL's micro-batches; returns the logits of each."""
    outputs = []

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        ids = b["input_ids"] if b["input_ids"].ndim == 2 else b["input_ids"][None]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        output = model(ids, positions, None)
        outputs.append(output.detach().clone())

        def loss(out):
            value = out.float().sum() * 1e-3
            return value, {"loss": value.detach()}

        return output, loss

    hook.forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=microbatches[0]["input_ids"].shape[-1],
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return outputs


@pytest.mark.parametrize(
    ("packed", "align"), [(False, 1), (True, 1), (True, 4)], ids=["right-padded", "packed", "packed-aligned-4"]
)
def test_one_step_from_skyrls_batch_replays_exactly_and_matches_skyrls_own_replay(
    skyrl, cpu_megatron, packed, align, monkeypatch
):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from torch_r3.integrations.skyrl import microbatch
    from torch_r3.megatron import ReplayHook

    model = only_model(monkeypatch)
    batch = skyrl_batch(skyrl, seed=11, n=4)
    chunks = batch.chunk(2 if packed else 1)
    layout_value = Packed(pad_to_multiple_of=align) if packed else Padded(side="right")
    ours = [microbatch(c, layout=layout_value) for c in chunks]
    if packed:  # the CPU model runs a packed micro-batch as one [1, N] row (no THD kernels here)
        for b in ours:
            b["input_ids"] = b["input_ids"][None]

    # SkyRL's own path (one sequence per right-padded micro-batch: see the next test): its alignment and RouterReplay set-up, then the model, per micro-batch.
    theirs = []
    with torch.no_grad():
        for c in chunks:
            layout = skyrl_layout(skyrl, c["attention_mask"], packed=packed, align=align)
            kwargs = skyrl["replay"].setup_per_microbatch_replay_forward(
                c["rollout_expert_indices"],
                c["router_padding_mask"],
                c["attention_mask"].bool(),
                model,
                model.config,
                layout,
                remove_microbatch_padding=packed,
            )
            ids = (ours[len(theirs)]["input_ids"]).reshape(-1 if packed else len(c), *(() if packed else (-1,)))
            ids = ids[None] if packed else ids
            theirs.append(model(ids, torch.arange(ids.shape[1]).expand_as(ids), None, **kwargs).clone())
            skyrl["replay"].clear_router_replay()
    assert not any(r.target_topk_idx is not None for r in RouterReplay.global_router_replay_instances)

    # torch_r3's path, replaying SkyRL's filler rows too (uncaptured="replay"): the same logits, bit for bit.
    with ReplayHook(model, uncaptured="replay") as hook, torch.no_grad():
        replayed = run(model, hook, ours, forward_only=True)
    for a, b in zip(replayed, theirs, strict=True):
        assert torch.equal(a, b)

    # A training step with live routing of uncaptured tokens: every captured route replayed exactly.
    recorder = RouteRecorder(model)
    with ReplayHook(model) as hook:
        run(model, hook, ours, forward_only=False)
        stats = hook.last_stats
    recorder.close()
    assert stats is not None and stats.microbatches == len(ours) and set(stats.route_drift) == {0, 1}
    assert stats.live_fraction > 0  # the uncaptured last tokens routed live
    for layer, calls in recorder.calls.items():
        assert len(calls) == len(ours)
        for (_, routing_map), b in zip(calls, ours):
            routes = b["rollout_expert_indices"][..., layer, :]
            mask = b["router_padding_mask"]
            if packed:
                routes, mask = routes[None], mask[None]
            captured = (~mask).transpose(0, 1).reshape(-1)
            assert torch.equal(routing_map[captured], expected_map(routes)[captured])


def test_skyrls_right_padded_replay_of_two_sequences_puts_routes_on_the_wrong_tokens(skyrl, cpu_megatron, monkeypatch):
    """Found while proving the swap: SkyRL 0.4.0 flattens a right-padded micro-batch's routes batch-first
    (`_split_replay_indices`: `[L, B * T, K]`) while Megatron's routers read tokens sequence-first
    (`[T * B]`), so with more than one sequence per micro-batch and no packing, token (t, b) replays
    the route of flat index t * B + b read batch-first. The hook installs them sequence-first."""
    from torch_r3.integrations.skyrl import microbatch
    from torch_r3.megatron import ReplayHook

    model = only_model(monkeypatch)
    chunk = skyrl_batch(skyrl, seed=11, n=2)
    ours = microbatch(chunk)
    routes = ours["rollout_expert_indices"]  # [B, T, L, K]
    b, t = routes.shape[:2]
    recorder = RouteRecorder(model)
    with torch.no_grad():
        layout = skyrl_layout(skyrl, chunk["attention_mask"], packed=False, align=1)
        kwargs = skyrl["replay"].setup_per_microbatch_replay_forward(
            chunk["rollout_expert_indices"],
            chunk["router_padding_mask"],
            chunk["attention_mask"].bool(),
            model,
            model.config,
            layout,
        )
        ids = ours["input_ids"]
        model(ids, torch.arange(t).expand_as(ids), None, **kwargs)
        skyrl["replay"].clear_router_replay()
    skyrl_maps = {layer: calls[0][1] for layer, calls in recorder.calls.items()}
    recorder.clear()
    with ReplayHook(model, uncaptured="replay") as hook, torch.no_grad():
        run(model, hook, [ours], forward_only=True)
    recorder.close()
    for layer, calls in recorder.calls.items():
        sequence_first = expected_map(routes[:, :, layer])  # token (t, b) at row t * B + b
        batch_first = torch.zeros_like(sequence_first).scatter(
            1, routes[:, :, layer].long().reshape(b * t, -1), True
        )  # row t * B + b holds the route of (b', t') = divmod(t * B + b, T)
        assert torch.equal(calls[0][1], sequence_first)
        assert torch.equal(skyrl_maps[layer], batch_first)
        assert not torch.equal(skyrl_maps[layer], sequence_first)


@pytest.mark.parametrize("short", [1, 4])
def test_packed_routes_shorter_than_their_segments_are_refused_naming_the_trajectory(skyrl, short):
    """Defect: a `PackedTensor` whose values end before `cu_seqlens[-1]` was accepted, and the missing
    captured rows of its last trajectories routed live without a word. SkyRL's `PackedTensor` checks
    this at construction; the object here is one whose values were replaced afterwards."""
    from torch_r3.integrations.skyrl import microbatch

    batch = skyrl_batch(skyrl, seed=4, n=3)
    routes = batch["rollout_expert_indices"]
    ends = routes.cu_seqlens.tolist()
    routes.values = routes.values[: ends[-1] - short]
    first_cut = next(i for i in range(3) if ends[i + 1] > ends[-1] - short)
    with pytest.raises(
        ValueError,
        match=rf"rollout_expert_indices: trajectory {first_cut}'s segment \[{ends[first_cut]}, {ends[first_cut + 1]}\) ends past the {ends[-1] - short} value rows",
    ):
        microbatch(batch)


def test_packed_view_is_skyrls_own_routes_equal_to_its_alignment_and_to_microbatch(skyrl):
    """SkyRL's default packed layout (TP = CP = 1): the hook's batch is SkyRL's tensor, checked, not a copy (issue 44)."""
    from torch_r3.integrations.skyrl import microbatch
    from torch_r3.integrations.skyrl.worker import packed_view

    batch = skyrl_batch(skyrl, seed=3)
    for size in (1, 3):
        for chunk in batch.chunk(size):
            view = packed_view(chunk)
            assert view is not None
            values = chunk["rollout_expert_indices"].values
            assert view["rollout_expert_indices"].data_ptr() == values.data_ptr()  # no second collation
            layout = skyrl_layout(skyrl, chunk["attention_mask"], packed=True, align=1)
            filler = skyrl["replay"].replay_padding_row(TOPK, dtype=values.dtype)
            theirs = skyrl["metadata"].align_packed_token_metadata(chunk["rollout_expert_indices"], layout, filler)[0]
            mask = skyrl["metadata"].align_token_metadata(chunk["router_padding_mask"], layout, True)[0]
            assert torch.equal(view["rollout_expert_indices"], theirs)
            assert torch.equal(view["router_padding_mask"], mask)
            ours = microbatch(chunk, layout=Packed())
            assert list(view) == list(ours)
            for key in ours:
                assert view[key].dtype == ours[key].dtype and torch.equal(view[key], ours[key]), key


def test_packed_view_leaves_a_batch_with_another_filler_to_microbatch_and_checks_the_mask(skyrl):
    from torch_r3.integrations.skyrl import microbatch
    from torch_r3.integrations.skyrl.worker import packed_view

    chunk = skyrl_batch(skyrl, seed=5, n=2)
    fields = {k: chunk[k] for k in ("sequences", "attention_mask", "rollout_expert_indices", "router_padding_mask")}
    packed = fields["rollout_expert_indices"]
    tail = int(packed.cu_seqlens[1]) - 1  # trajectory 0's last token: uncaptured, filler 0..K-1
    assert bool(fields["router_padding_mask"][0, -1])
    packed.values[tail] = packed.values[tail].flip(-1)  # still K distinct experts, not the filler
    assert packed_view(fields) is None
    assert torch.equal(microbatch(fields, layout=Packed())["rollout_expert_indices"][tail, 0], torch.arange(TOPK))
    mask = fields["router_padding_mask"].clone()
    start = int((~fields["attention_mask"].bool()[1]).sum())
    mask[1, start] = True  # a gap before captured tokens
    with pytest.raises(ValueError, match=r"router_padding_mask\[1\]: its captured tokens are not a prefix"):
        packed_view({**fields, "router_padding_mask": mask})
