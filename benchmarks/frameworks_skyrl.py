"""The SkyRL cases of `benchmarks/frameworks.py`: its controller, its worker's micro-batch, its worker step."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks import frameworks_common as common
from benchmarks.megatron_model import worker_model
from torch_r3 import BufferPool, Memory, Packed

__all__ = ["skyrl", "skyrl_worker_step"]


def skyrl(args) -> None:
    L, K = common.L, common.K  # read at call time: a test shrinks them
    preprocess, metadata, replay = common.load(
        "skyrl",
        "skyrl.train.dataset.preprocess",
        "skyrl.backends.skyrl_train.distributed.megatron.token_metadata",
        "skyrl.backends.skyrl_train.utils.replay_utils",
    )
    from torch_r3.integrations import skyrl as integration

    prompts, responses = common.rl_lengths(args.batch, 1024, 4096)
    routes = common.routes_for(prompts, responses)
    total = np.asarray(prompts) + np.asarray(responses)
    pool = BufferPool()
    theirs = preprocess._collate_rollout_expert_indices(routes, total)
    ours = integration.collate_rollout_expert_indices(routes, total, memory=Memory(buffers=pool))
    assert torch.equal(theirs.values, ours.values) and torch.equal(theirs.cu_seqlens, ours.cu_seqlens)
    nbytes = theirs.values.nbytes
    del ours
    cases = {
        f"SkyRL {args.skyrl}: _collate_rollout_expert_indices": lambda: preprocess._collate_rollout_expert_indices(
            routes, total
        ),
        "torch_r3: collate_rollout_expert_indices": lambda: integration.collate_rollout_expert_indices(routes, total),
        "torch_r3: collate_rollout_expert_indices, BufferPool": lambda: integration.collate_rollout_expert_indices(
            routes, total, memory=Memory(buffers=pool)
        ),
    }
    common.report(
        f"SkyRL controller, packed: {args.batch} trajectories, {int(total.sum())} tokens, {L} layers x top-{K} uint8",
        common.timed(cases, args.rounds),
        nbytes,
        next(iter(cases)),
    )

    # One worker micro-batch, right-padded (remove_left_padding), from the controller's batch form.
    mb = slice(0, args.micro_batch)
    sub = theirs[mb]
    n = total[mb]
    t = int(n.max())
    attention = torch.zeros(len(n), t, dtype=torch.long)
    for i, k in enumerate(n.tolist()):
        attention[i, t - k :] = 1
    mask = preprocess.make_router_padding_mask(attention, [len(r) for r in routes[mb]])
    batch = {
        "sequences": attention.clone(),
        "attention_mask": attention,
        "rollout_expert_indices": sub,
        "router_padding_mask": mask,
    }
    layout = metadata.canonical_token_metadata_layout(attention)
    filler = replay.replay_padding_row(K, dtype=sub.dtype)

    def skyrl_align():
        return (
            metadata.align_packed_token_metadata(sub, layout, filler),
            metadata.align_token_metadata(mask, layout, True),
        )

    worker_pool = BufferPool()
    ref = skyrl_align()
    got = integration.microbatch(batch, memory=Memory(buffers=worker_pool))
    assert torch.equal(ref[0], got["rollout_expert_indices"]) and torch.equal(ref[1], got["router_padding_mask"])
    nbytes = ref[0].nbytes
    del got
    cases = {
        f"SkyRL {args.skyrl}: align_(packed_)token_metadata": skyrl_align,
        "torch_r3: skyrl.microbatch, BufferPool": lambda: integration.microbatch(
            batch, memory=Memory(buffers=worker_pool)
        ),
    }
    common.report(
        f"SkyRL worker, right-padded micro-batch of {args.micro_batch}: [{args.micro_batch}, {t}, {L}, {K}]",
        common.timed(cases, args.rounds),
        nbytes,
        next(iter(cases)),
    )


# --------------------------------------------------------------------------------------------
# SkyRL's Megatron worker step set-up (replay alignment + installation), per step and per token


def _worker_micro(trajectories: int, preprocess, training_batch) -> tuple[list, np.ndarray]:
    """One step's micro-batches of 1 as SkyRL's worker gets them, and each trajectory's tokens."""
    L, K, EXPERTS = common.L, common.K, common.EXPERTS
    prompts, responses = common.rl_lengths(trajectories, 1024, 4096, seed=4)
    rng = np.random.default_rng(5)
    stride = np.arange(K, dtype=np.int64) * (EXPERTS // K)  # K distinct experts per route, as a router picks
    routes = [
        ((rng.integers(0, EXPERTS, (p + r - 1, L, 1)) + stride) % EXPERTS).astype(np.uint8)
        for p, r in zip(prompts, responses)
    ]
    total = np.asarray(prompts) + np.asarray(responses)
    seqs = preprocess.convert_prompts_responses_to_batch_tensors(
        0,
        [[1] * p for p in prompts],
        [[1] * r for r in responses],
        [[0.0] * r for r in responses],
        [[1] * r for r in responses],
        None,
        routes,
    )
    batch = training_batch.TrainingInputBatch(
        {
            "sequences": seqs[0],
            "attention_mask": seqs[1],
            "rollout_expert_indices": seqs[6],
            "router_padding_mask": preprocess.make_router_padding_mask(seqs[1], [len(r) for r in routes]),
        }
    )
    micro = [
        (c["rollout_expert_indices"], c["router_padding_mask"], c["attention_mask"].bool()) for c in batch.chunk(1)
    ]
    return micro, total


def skyrl_worker_step(args) -> None:
    """SkyRL's per-micro-batch replay set-up against `install(worker=True)`'s, over one step.

    One step: `--step-batch` trajectories at SkyRL's defaults (`micro_train_batch_size_per_gpu=1`,
    `remove_microbatch_padding=True`: packed, each sequence aligned as `build_token_metadata_layout`
    says), 40 layers x top-8 of 128 experts. Timed: what SkyRL's forward-step closure does for replay
    before the model call and after it (`build_token_metadata_layout`,
    `setup_per_microbatch_replay_forward`, `setup_per_microbatch_replay_backward`, inside
    `router_replay_schedule`), against the same calls installed (`SkyRLWorkerReplay`: collation
    into the hook's batch, `ReplayHook.begin_microbatch`'s checks and installation, the step's drain
    check and statistics). No model forward runs. Equality first: SkyRL's aligned routes of each
    micro-batch against the hook's.
    """
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from torch_r3.integrations.skyrl import SkyRLWorkerReplay, microbatch
    from torch_r3.megatron._cpu import megatron_on_cpu

    preprocess, metadata, replay, training_batch = common.load(
        "skyrl",
        "skyrl.train.dataset.preprocess",
        "skyrl.backends.skyrl_train.distributed.megatron.token_metadata",
        "skyrl.backends.skyrl_train.utils.replay_utils",
        "skyrl.backends.skyrl_train.training_batch",
    )
    common.megatron_world_of_one()
    L, K, EXPERTS = common.L, common.K, common.EXPERTS  # read at call time: a test shrinks them
    micro, total = _worker_micro(args.step_batch, preprocess, training_batch)
    with megatron_on_cpu():
        model = worker_model(L, EXPERTS, K)
        RouterReplay.global_router_replay_instances = [
            m.router_replay for m in model.modules() if isinstance(m, TopKRouter)
        ]
        side = SkyRLWorkerReplay()

        def layout_of(attention):
            return metadata.build_token_metadata_layout(attention, attention.device, packed=True, fp8_enabled=False)

        def skyrl_step():
            with replay.router_replay_schedule(True):
                for r, m, a in micro:
                    replay.setup_per_microbatch_replay_forward(
                        r, m, a, model, model.config, layout_of(a), remove_microbatch_padding=True
                    )
                    replay.setup_per_microbatch_replay_backward()

        def setups(**kwargs):
            for r, m, a in micro:
                side.setup_per_microbatch_replay_forward(
                    r, m, a, model, model.config, layout_of(a), remove_microbatch_padding=True
                )
                side.setup_per_microbatch_replay_backward()

        def torch_r3_step():
            with side.router_replay_schedule(True):
                side.get_forward_backward_func(lambda: setups)()(
                    model=[model], num_microbatches=len(micro), forward_only=False
                )

        # Equality first: SkyRL's installed rows (its packed alignment) are the hook's batch, per micro-batch.
        for r, m, a in micro[:4]:
            layout = layout_of(a)
            theirs = metadata.align_packed_token_metadata(r, layout, replay.replay_padding_row(K, dtype=r.dtype))[0]
            multiple = int(np.gcd.reduce(layout.padded_sequence_lengths))
            ours = microbatch(
                {"sequences": a.long(), "attention_mask": a, "rollout_expert_indices": r, "router_padding_mask": m},
                layout=Packed(pad_to_multiple_of=multiple),
            )["rollout_expert_indices"]
            assert torch.equal(theirs, ours)
        skyrl_step()
        torch_r3_step()
        medians = common.timed(
            {f"SkyRL {args.skyrl}: its replay set-up": skyrl_step, "torch_r3: install(worker=True)": torch_r3_step},
            args.rounds,
        )
        side.close()
    tokens = int(total.sum())
    nbytes = sum(r.values.nbytes for r, _, _ in micro)
    print(
        f"\nSkyRL worker step set-up: {len(micro)} micro-batches of 1 (packed, SkyRL's defaults), {tokens} tokens, "
        f"{L} layers x top-{K} of {EXPERTS} experts ({nbytes / 1e6:.0f} MB of routes in)"
    )
    common.report_step(medians, tokens, 52, "SkyRL")
