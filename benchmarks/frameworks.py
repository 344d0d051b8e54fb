"""SkyRL 0.4.0's and verl 0.9.1's own route collation beside `torch_r3.integrations`, in one process.

Run it where the trainers are installed (`make frameworks` builds `.venv-frameworks`):

    PYTHONPATH=. .venv-frameworks/bin/python benchmarks/frameworks.py [--batch 192] [--rounds 5]

* SkyRL, packed (its controller): `preprocess._collate_rollout_expert_indices`
  against `torch_r3.integrations.skyrl.collate_rollout_expert_indices`, fresh
  and with a `BufferPool`.
* SkyRL, padded (its Megatron worker, `remove_microbatch_padding=False`): its
  `align_packed_token_metadata` + `align_token_metadata` of one micro-batch
  against `torch_r3.integrations.skyrl.microbatch`.
* SkyRL, its Megatron worker step set-up (`skyrl_worker_step`): SkyRL's
  replay alignment and installation for every micro-batch of one step against
  `install(worker=True)`'s, per step and per token, at SkyRL's defaults.
* verl (its agent loop, then its driver): a zero-filled int16 `[1, P + R, L, K]`
  per sample (the agent loop's three tensor operations: zeros, one slice copy,
  `torch.cat` of the batch), then verl's own `left_right_2_no_padding`, against
  `torch_r3.integrations.verl.nested_routed_experts` from the compact samples.
* verl's step, agent loop to actor (`verl_agent_loop_step`): from the server's
  per-sample routes to the actor's nested `routed_experts`, verl's path against
  `install()`'s (`keep_compact` per sample, `driver_routed_experts`), per step
  and per token, and the bytes shipped from agent loop to driver.
* verl's engine step set-up (`verl_engine_step`): what `MegatronEngine`'s
  `forward_backward_batch` and `forward_step` do for R3 replay (its
  `RouterReplayHelper` path: `align_r3_router_replay_data`,
  `build_r3_replay_mask`, `set_router_replay_data`) for every micro-batch of
  one THD step, against `install()`'s (`EngineReplay` and the hook), per step
  and per token.

Every output is checked equal to the framework's before timing counts. After
one warm-up round the cases run in interleaved rounds (each once per round) and the table gives
medians: on a loaded machine, read the ratios, not the absolute figures. SkyRL's
and verl's modules are loaded behind bare parent packages, as the tests load them
(`tests/integrations/frameworks.py`). A framework that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from torch_r3 import Memory, Packed, PromptResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from frameworks import installed, load

from torch_r3 import BufferPool

L, K, EXPERTS = 40, 8, 128


def rl_lengths(batch: int, prompt: int, response: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt // 4, prompt + 1, batch).tolist()
    responses = np.clip(rng.lognormal(np.log(response / 3), 0.7, batch), 8, response).astype(int).tolist()
    return prompts, responses


def routes_for(prompts, responses, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, EXPERTS, (p + r - 1, L, K), dtype=np.uint8) for p, r in zip(prompts, responses)]


def timed(cases: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():  # a warm-up round, not counted (first-touch page faults, pool fills)
        run()
    for _ in range(rounds):
        for name, run in cases.items():
            t0 = time.perf_counter()
            out = run()
            times[name].append(time.perf_counter() - t0)
            del out
    return {name: statistics.median(t) for name, t in times.items()}


def report(title: str, medians: dict[str, float], nbytes: int, baseline: str) -> None:
    print(f"\n{title} ({nbytes / 1e6:.0f} MB of routes out)")
    print(f"{'':<52} {'median ms':>10} {'GB/s':>6} {'vs ' + baseline.split(':')[0]:>12}")
    for name, t in medians.items():
        print(f"{name:<52} {t * 1e3:>10.1f} {nbytes / t / 1e9:>6.2f} {medians[baseline] / t:>11.2f}x")


def skyrl(args) -> None:
    preprocess, metadata, replay = load(
        "skyrl",
        "skyrl.train.dataset.preprocess",
        "skyrl.backends.skyrl_train.distributed.megatron.token_metadata",
        "skyrl.backends.skyrl_train.utils.replay_utils",
    )
    from torch_r3.integrations import skyrl as integration

    prompts, responses = rl_lengths(args.batch, 1024, 4096)
    routes = routes_for(prompts, responses)
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
    report(
        f"SkyRL controller, packed: {args.batch} trajectories, {int(total.sum())} tokens, {L} layers x top-{K} uint8",
        timed(cases, args.rounds),
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
    report(
        f"SkyRL worker, right-padded micro-batch of {args.micro_batch}: [{args.micro_batch}, {t}, {L}, {K}]",
        timed(cases, args.rounds),
        nbytes,
        next(iter(cases)),
    )


# --------------------------------------------------------------------------------------------
# SkyRL's Megatron worker step set-up (replay alignment + installation), per step and per token


def _worker_model(layers: int, experts: int, topk: int):
    """A GPTModel with `layers` MoE routers (tiny widths: the set-up cost is the routes', not the model's)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=16,
        ffn_hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        add_bias_linear=False,
        pipeline_dtype=torch.float32,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8192)


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
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from torch_r3.integrations.skyrl import SkyRLWorkerReplay, microbatch
    from torch_r3.megatron._cpu import megatron_on_cpu

    preprocess, metadata, replay, training_batch = load(
        "skyrl",
        "skyrl.train.dataset.preprocess",
        "skyrl.backends.skyrl_train.distributed.megatron.token_metadata",
        "skyrl.backends.skyrl_train.utils.replay_utils",
        "skyrl.backends.skyrl_train.training_batch",
    )
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    prompts, responses = rl_lengths(args.step_batch, 1024, 4096, seed=4)
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
    with megatron_on_cpu():
        model = _worker_model(L, EXPERTS, K)
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
        medians = timed(
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
    first = next(iter(medians))
    print(f"{'':<52} {'per step ms':>12} {'per token ns':>13} {'vs SkyRL':>9}")
    for name, t in medians.items():
        print(f"{name:<52} {t * 1e3:>12.1f} {t / tokens * 1e9:>13.1f} {medians[first] / t:>8.2f}x")


def verl(args) -> None:
    (padding,) = load("verl", "verl.workers.utils.padding")
    from tensordict import TensorDict

    from torch_r3.integrations.verl import nested_routed_experts, padded_routed_experts

    P, R = 1024, 2048
    prompts, responses = rl_lengths(args.batch, P, R, seed=2)
    routes = routes_for(prompts, responses, seed=3)
    b = len(prompts)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)

    def agent_loop():
        per_sample = []
        for p, rows in zip(prompts, routes):  # the agent loop, per sample: zeros int16, one slice copy
            out = torch.zeros(1, P + R, L, K, dtype=torch.int16)
            out[:, P - p : P - p + rows.shape[0]] = torch.from_numpy(rows).to(torch.int16).unsqueeze(0)
            per_sample.append(out)
        return torch.cat(per_sample, 0)  # the driver's batch

    def verl_path():
        data = TensorDict(
            {
                "input_ids": attention.clone(),
                "attention_mask": attention,
                "response_mask": response_mask,
                "position_ids": positions,
                "routed_experts": agent_loop(),
            },
            batch_size=[b],
        )
        return padding.left_right_2_no_padding(data)["routed_experts"]

    counts = [p + r for p, r in zip(prompts, responses)]
    padded = padded_routed_experts(
        routes,
        prompts,
        responses,
        layout=PromptResponse(prompt_width=P, response_width=R),
    )
    assert torch.equal(agent_loop(), padded["rollout_expert_indices"])
    padded_bytes = padded["rollout_expert_indices"].nbytes
    del padded
    cases = {
        f"verl {args.verl}: agent loop zeros + slice copy, torch.cat": agent_loop,
        "torch_r3: verl.padded_routed_experts": lambda: padded_routed_experts(
            routes,
            prompts,
            responses,
            layout=PromptResponse(prompt_width=P, response_width=R),
        ),
    }
    report(
        f"verl agent loop to driver: {b} samples, P={P} R={R}, padded int16 [B, P + R, {L}, {K}] out",
        timed(cases, args.rounds),
        padded_bytes,
        next(iter(cases)),
    )
    theirs = verl_path()
    ours, _ = nested_routed_experts(routes, counts)
    assert torch.equal(theirs.values(), ours.values()) and torch.equal(theirs.offsets(), ours.offsets())
    nbytes = theirs.values().nbytes
    del theirs, ours
    cases = {
        f"verl {args.verl}: agent loop zeros + cat + left_right_2_no_padding": verl_path,
        "torch_r3: verl.nested_routed_experts": lambda: nested_routed_experts(routes, counts),
    }
    report(
        f"verl driver: {b} samples, P={P} R={R}, {sum(counts)} tokens, {L} layers x top-{K}, int16 nested out",
        timed(cases, args.rounds),
        nbytes,
        next(iter(cases)),
    )


def verl_agent_loop_step(args) -> None:
    """verl's agent loop plus driver against the compact path, one training step's routes, per step and per token.

    From what the rollout server returns per sample (`int32` `[rows, L, K]`,
    `n - 1` rows) to the nested `routed_experts` the actor receives. verl: the
    agent loop's per-sample cast, zeros and slice copy (`agent_loop.py`
    783-809), the worker's `torch.cat` (1075), the driver's
    `left_right_2_no_padding` (verl's own). torch_r3 (`install()`): the agent
    loop's `keep_compact` per sample (`compact_sample_routes`), the driver's
    `driver_routed_experts` from the `non_tensor_batch` column. Also the bytes
    the agent loop ships to the driver in each form.
    """
    (padding,) = load("verl", "verl.workers.utils.padding")
    from tensordict import TensorDict

    from torch_r3.integrations.verl import compact_sample_routes, driver_routed_experts

    P, R = 1024, 2048
    prompts, responses = rl_lengths(args.batch, P, R, seed=4)
    rng = np.random.default_rng(5)
    server = [rng.integers(0, EXPERTS, (p + r - 1, L, K), dtype=np.int32) for p, r in zip(prompts, responses)]
    b = len(prompts)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    tokens = int(attention.sum())

    def verl_agent_loop():
        per_sample = []
        for p, rows in zip(prompts, server):  # agent_loop.py:783-809, per sample
            experts = torch.from_numpy(rows).to(torch.int16)
            out = torch.zeros(1, P + R, L, K, dtype=torch.int16)
            out[:, P - p : P - p + rows.shape[0]] = experts.unsqueeze(0)
            per_sample.append(out)
        return torch.cat(per_sample, 0)  # agent_loop.py:1075, the worker's batch

    def verl_step():
        data = TensorDict(
            {
                "input_ids": attention.clone(),
                "attention_mask": attention,
                "response_mask": response_mask,
                "position_ids": positions,
                "routed_experts": verl_agent_loop(),
            },
            batch_size=[b],
        )
        return padding.left_right_2_no_padding(data)["routed_experts"]

    def compact_agent_loop():
        return [compact_sample_routes(rows, num_experts=EXPERTS) for rows in server]

    def compact_step():
        return driver_routed_experts(compact_agent_loop(), attention)

    theirs, ours = verl_step(), compact_step()
    assert torch.equal(theirs.values(), ours.values()) and torch.equal(theirs.offsets(), ours.offsets())
    shipped_verl = b * (P + R) * L * K * 2
    shipped_ours = sum(a.nbytes for a in compact_agent_loop())
    del theirs, ours
    cases = {
        f"verl {args.verl}: agent loop (cast, zeros, copy, cat) + driver": verl_step,
        "torch_r3: keep_compact + driver_routed_experts": compact_step,
        f"verl {args.verl}: agent loop only": verl_agent_loop,
        "torch_r3: keep_compact only": compact_agent_loop,
    }
    medians = timed(cases, args.rounds)
    print(
        f"\nverl step, agent loop to actor: {b} samples, P={P} R={R}, {tokens} tokens, {L} layers x top-{K}; "
        f"shipped agent loop -> driver: verl {shipped_verl / 1e6:.0f} MB (int16, padded), "
        f"torch_r3 {shipped_ours / 1e6:.0f} MB (uint8, captured rows)"
    )
    print(f"{'':<56} {'ms/step':>9} {'ns/token':>9} {'vs verl':>8}")
    names = list(cases)
    for name in names:
        base = medians[names[0]] if name in names[:2] else medians[names[2]]
        t = medians[name]
        print(f"{name:<56} {t * 1e3:>9.1f} {t / tokens * 1e9:>9.1f} {base / t:>7.2f}x")


def verl_engine_step(args) -> None:
    """verl's per-micro-batch R3 set-up in `MegatronEngine.forward_step` against `install()`'s, over one step.

    One step: `--step-batch` samples of verl's THD batch (the nested
    `input_ids`, `response_mask` and `routed_experts` of `left_right_2_no_padding`,
    int16, each sequence's last row verl's zero row), in micro-batches of
    `--verl-micro-batch`, 40 layers x top-8 of 128 experts. verl: what
    `forward_backward_batch` and `forward_step` do for replay around the model
    call (the global `REPLAY_FORWARD`, per micro-batch `RouterReplayHelper`'s
    action checks, `align_r3_router_replay_data`, `build_r3_replay_mask`,
    `set_router_replay_data` into verl's own `RouterReplay` instances, the switch
    to `REPLAY_BACKWARD`; then the clear). torch_r3: `install()`'s
    `forward_backward_batch` wrapper and schedule (`EngineReplay`: each micro-batch
    into the hook's packed batch, `ReplayHook.begin_microbatch` / `end_microbatch`,
    the step's drain check and statistics), Megatron's schedule replaced by a loop
    that calls the forward step once per micro-batch. No model forward runs.
    Equality first: the rows verl replays, per router, are the hook's.
    """
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter
    from tensordict import TensorDict

    from torch_r3.integrations.verl import microbatch as verl_microbatch
    from torch_r3.integrations.verl.schedule import EngineReplay
    from torch_r3.megatron._cpu import megatron_on_cpu

    padding, utils, patch, tu = load(
        "verl",
        "verl.workers.utils.padding",
        "verl.utils.megatron.router_replay_utils",
        "verl.utils.megatron.router_replay_patch",
        "verl.utils.tensordict_utils",
    )
    utils.device_name = "cpu"  # verl moves the packed routes to its device name, "cuda" without an accelerator
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    P, R = 1024, 2048
    prompts, responses = rl_lengths(args.step_batch, P, R, seed=6)
    rng = np.random.default_rng(7)
    stride = np.arange(K, dtype=np.int64) * (EXPERTS // K)  # K distinct experts per route
    b = len(prompts)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R, dtype=torch.long)
    routed = torch.zeros(b, P + R, L, K, dtype=torch.int16)  # verl's agent loop: zeros, the rollout's n - 1 rows
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
        rows = (rng.integers(0, EXPERTS, (p + r - 1, L, 1)) + stride) % EXPERTS
        routed[i, P - p : P + r - 1] = torch.from_numpy(rows)
    ids = attention.clone()
    micro = []
    for start in range(0, b, args.verl_micro_batch):
        part = slice(start, start + args.verl_micro_batch)
        data = TensorDict(
            {
                "input_ids": ids[part],
                "attention_mask": attention[part],
                "response_mask": response_mask[part],
                "position_ids": (attention[part].cumsum(1) - 1).clamp(min=0),
                "routed_experts": routed[part],
            },
            batch_size=[len(ids[part])],
        )
        micro.append(padding.left_right_2_no_padding(data))
    tokens = int(attention.sum())
    with megatron_on_cpu():
        theirs_model = _worker_model(L, EXPERTS, K)
        ours_model = _worker_model(L, EXPERTS, K)
    for module in theirs_model.modules():  # verl's RouterReplay on its model's routers (its patch does this)
        if isinstance(module, TopKRouter):
            module.router_replay = patch.RouterReplay()
    config = theirs_model.config
    helper, action = utils.RouterReplayHelper, patch.RouterReplayAction

    def verl_step():
        patch.RouterReplay.set_global_router_replay_action(action.REPLAY_FORWARD)
        for mb in micro:
            if helper.is_replay_backward_action(config, 0, model=theirs_model):
                utils.set_model_router_replay_action(theirs_model, action.REPLAY_FORWARD)
            if helper.is_replay_forward_action(config, 0, model=theirs_model):
                routes = utils.align_r3_router_replay_data(mb["routed_experts"], mb["input_ids"])
                mask = utils.build_r3_replay_mask(mb["input_ids"], mb["response_mask"])
                utils.set_router_replay_data(routes, None, config, 0, replay_mask=mask, model=theirs_model)
            if helper.is_replay_forward_action(config, 0, model=theirs_model):
                utils.set_model_router_replay_action(theirs_model, action.REPLAY_BACKWARD)

    def verl_clear():
        patch.RouterReplay.clear_global_indices()
        patch.RouterReplay.clear_global_router_replay_action()

    replay = EngineReplay()
    engine = SimpleNamespace(
        enable_routing_replay=True, engine_config=SimpleNamespace(router_replay=SimpleNamespace(mode="R3"))
    )
    step_data = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(step_data, enable_routing_replay=True)

    def megatron_schedule(**kwargs):  # Megatron's schedule without the model: each micro-batch's forward step, once
        return [kwargs["forward_step_func"](kwargs["data_iterator"], kwargs["model"]) for _ in micro]

    def engine_step(engine, data, loss_function, forward_only):  # verl's forward_backward_batch, its replay part
        schedule = replay.get_forward_backward_func(lambda: megatron_schedule)()
        return schedule(
            forward_step_func=lambda data_iterator, model: next(data_iterator),
            data_iterator=iter(micro),
            model=[ours_model],
            num_microbatches=len(micro),
            forward_only=forward_only,
        )

    installed_step = replay.forward_backward_batch(engine_step)

    def torch_r3_step():
        return installed_step(engine, step_data, None, False)

    # Equality first (the last micro-batch): the rows verl replays, per router, are the hook's batch's captured rows.
    verl_step()
    theirs = [r.target_topk_idx for _, r in utils.iter_model_routers(theirs_model)]
    their_mask = next(utils.iter_model_routers(theirs_model))[1].target_replay_mask
    verl_clear()
    ours = verl_microbatch(micro[-1]["routed_experts"], micro[-1]["input_ids"], layout=Packed())
    captured = ~ours["router_padding_mask"]
    assert torch.equal(captured, their_mask)
    for j, rows in enumerate(theirs):
        assert torch.equal(ours["rollout_expert_indices"][:, j][captured].long(), rows[captured])
    torch_r3_step()
    medians = timed(
        {
            f"verl {args.verl}: its R3 set-up (RouterReplayHelper path)": lambda: (verl_step(), verl_clear()),
            "torch_r3: install(), EngineReplay": torch_r3_step,
        },
        args.rounds,
    )
    replay.close()
    nbytes = sum(mb["routed_experts"].values().nbytes for mb in micro)
    print(
        f"\nverl engine step set-up: {len(micro)} micro-batches of {args.verl_micro_batch} (THD), {tokens} tokens, "
        f"{L} layers x top-{K} of {EXPERTS} experts ({nbytes / 1e6:.0f} MB of int16 routes in)"
    )
    first = next(iter(medians))
    print(f"{'':<56} {'per step ms':>12} {'per token ns':>13} {'vs verl':>8}")
    for name, t in medians.items():
        print(f"{name:<56} {t * 1e3:>12.1f} {t / tokens * 1e9:>13.1f} {medians[first] / t:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument(
        "--step-batch", type=int, default=16, help="trajectories in the SkyRL worker step (micro-batches of 1)"
    )
    ap.add_argument(
        "--verl-micro-batch", type=int, default=4, help="samples per micro-batch in the verl engine step (THD)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (SkyRL's and verl's copies are torch ops; on a loaded 2-core machine "
        "2 threads made them up to 10x slower than 1, so 1, their best there, is the default)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    from importlib.metadata import version

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); one warm-up round, then "
        f"{args.rounds} interleaved rounds, medians (on a loaded machine: read the ratios)"
    )
    for name, run in (("skyrl", skyrl), ("verl", verl), ("verl", verl_agent_loop_step)):
        if not installed(name):
            print(f"\n{name}: not installed here, skipped (make frameworks builds .venv-frameworks with it)")
            continue
        setattr(args, name, version(name))
        run(args)
        if name == "skyrl" and installed("megatron"):
            skyrl_worker_step(args)
        if run is verl_agent_loop_step and installed("megatron"):
            verl_engine_step(args)


if __name__ == "__main__":
    main()
