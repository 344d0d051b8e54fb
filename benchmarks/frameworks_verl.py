"""The verl cases of `benchmarks/frameworks.py`: its agent loop and driver, its step to the actor, its engine step."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks import frameworks_common as common
from benchmarks.megatron_model import worker_model
from torch_r3 import Packed, PromptResponse

__all__ = ["verl", "verl_agent_loop_step", "verl_engine_step"]


def _verl_masks(prompts: list[int], responses: list[int], P: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's `attention_mask` `[B, P + R]` (prompts left-padded, responses right-padded) and `response_mask` `[B, R]`."""
    b = len(prompts)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    return attention, response_mask


def _no_padding(padding, ids, attention, response_mask, positions, routed):
    """verl's own `left_right_2_no_padding` of a padded batch: its nested (THD) `TensorDict`."""
    from tensordict import TensorDict

    data = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response_mask,
            "position_ids": positions,
            "routed_experts": routed,
        },
        batch_size=[len(ids)],
    )
    return padding.left_right_2_no_padding(data)


def verl(args) -> None:
    L, K = common.L, common.K  # read at call time: a test shrinks them
    (padding,) = common.load("verl", "verl.workers.utils.padding")

    from torch_r3.integrations.verl import nested_routed_experts, padded_routed_experts

    P, R = 1024, 2048
    prompts, responses = common.rl_lengths(args.batch, P, R, seed=2)
    routes = common.routes_for(prompts, responses, seed=3)
    b = len(prompts)
    attention, response_mask = _verl_masks(prompts, responses, P, R)
    positions = (attention.cumsum(1) - 1).clamp(min=0)

    def agent_loop():
        per_sample = []
        for p, rows in zip(prompts, routes):  # the agent loop, per sample: zeros int16, one slice copy
            out = torch.zeros(1, P + R, L, K, dtype=torch.int16)
            out[:, P - p : P - p + rows.shape[0]] = torch.from_numpy(rows).to(torch.int16).unsqueeze(0)
            per_sample.append(out)
        return torch.cat(per_sample, 0)  # the driver's batch

    def verl_path():
        return _no_padding(padding, attention.clone(), attention, response_mask, positions, agent_loop())[
            "routed_experts"
        ]

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
    common.report(
        f"verl agent loop to driver: {b} samples, P={P} R={R}, padded int16 [B, P + R, {L}, {K}] out",
        common.timed(cases, args.rounds),
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
    common.report(
        f"verl driver: {b} samples, P={P} R={R}, {sum(counts)} tokens, {L} layers x top-{K}, int16 nested out",
        common.timed(cases, args.rounds),
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
    L, K, EXPERTS = common.L, common.K, common.EXPERTS  # read at call time: a test shrinks them
    (padding,) = common.load("verl", "verl.workers.utils.padding")

    from torch_r3.integrations.verl import compact_sample_routes, driver_routed_experts

    P, R = 1024, 2048
    prompts, responses = common.rl_lengths(args.batch, P, R, seed=4)
    rng = np.random.default_rng(5)
    stride = np.arange(K, dtype=np.int64) * (EXPERTS // K)  # K distinct experts per route, as a router picks
    server = [
        ((rng.integers(0, EXPERTS, (p + r - 1, L, 1)) + stride) % EXPERTS).astype(np.int32)
        for p, r in zip(prompts, responses)
    ]
    b = len(prompts)
    attention, response_mask = _verl_masks(prompts, responses, P, R)
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
        return _no_padding(padding, attention.clone(), attention, response_mask, positions, verl_agent_loop())[
            "routed_experts"
        ]

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
    medians = common.timed(cases, args.rounds)
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


def _engine_micro(samples: int, micro_batch: int, padding) -> tuple[list, int]:
    """One step's THD micro-batches as verl's engine gets them (`left_right_2_no_padding`), and the step's tokens."""
    L, K, EXPERTS = common.L, common.K, common.EXPERTS
    P, R = 1024, 2048
    prompts, responses = common.rl_lengths(samples, P, R, seed=6)
    rng = np.random.default_rng(7)
    stride = np.arange(K, dtype=np.int64) * (EXPERTS // K)  # K distinct experts per route
    b = len(prompts)
    attention, response_mask = _verl_masks(prompts, responses, P, R)
    routed = torch.zeros(b, P + R, L, K, dtype=torch.int16)  # verl's agent loop: zeros, the rollout's n - 1 rows
    for i, (p, r) in enumerate(zip(prompts, responses)):
        rows = (rng.integers(0, EXPERTS, (p + r - 1, L, 1)) + stride) % EXPERTS
        routed[i, P - p : P + r - 1] = torch.from_numpy(rows)
    ids = attention.clone()
    micro = []
    for start in range(0, b, micro_batch):
        part = slice(start, start + micro_batch)
        positions = (attention[part].cumsum(1) - 1).clamp(min=0)
        micro.append(_no_padding(padding, ids[part], attention[part], response_mask[part], positions, routed[part]))
    tokens = int(attention.sum())
    return micro, tokens


def _verl_replay(micro: list, model, utils, patch):
    """verl's R3 set-up of one step on `model` (`verl_step`), and its clear at the step's end (`verl_clear`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():  # verl's RouterReplay on its model's routers (its patch does this)
        if isinstance(module, TopKRouter):
            module.router_replay = patch.RouterReplay()
    config = model.config
    helper, action = utils.RouterReplayHelper, patch.RouterReplayAction

    def verl_step():
        patch.RouterReplay.set_global_router_replay_action(action.REPLAY_FORWARD)
        for mb in micro:
            if helper.is_replay_backward_action(config, 0, model=model):
                utils.set_model_router_replay_action(model, action.REPLAY_FORWARD)
            if helper.is_replay_forward_action(config, 0, model=model):
                routes = utils.align_r3_router_replay_data(mb["routed_experts"], mb["input_ids"])
                mask = utils.build_r3_replay_mask(mb["input_ids"], mb["response_mask"])
                utils.set_router_replay_data(routes, None, config, 0, replay_mask=mask, model=model)
            if helper.is_replay_forward_action(config, 0, model=model):
                utils.set_model_router_replay_action(model, action.REPLAY_BACKWARD)

    def verl_clear():
        patch.RouterReplay.clear_global_indices()
        patch.RouterReplay.clear_global_router_replay_action()

    return verl_step, verl_clear


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

    from tensordict import TensorDict

    from torch_r3.integrations.verl import microbatch as verl_microbatch
    from torch_r3.integrations.verl.schedule import EngineReplay
    from torch_r3.megatron._cpu import megatron_on_cpu

    padding, utils, patch, tu = common.load(
        "verl",
        "verl.workers.utils.padding",
        "verl.utils.megatron.router_replay_utils",
        "verl.utils.megatron.router_replay_patch",
        "verl.utils.tensordict_utils",
    )
    utils.device_name = "cpu"  # verl moves the packed routes to its device name, "cuda" without an accelerator
    common.megatron_world_of_one()
    L, K, EXPERTS = common.L, common.K, common.EXPERTS  # read at call time: a test shrinks them
    micro, tokens = _engine_micro(args.step_batch, args.verl_micro_batch, padding)
    with megatron_on_cpu():
        theirs_model = worker_model(L, EXPERTS, K)
        ours_model = worker_model(L, EXPERTS, K)
    verl_step, verl_clear = _verl_replay(micro, theirs_model, utils, patch)
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
    medians = common.timed(
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
    common.report_step(medians, tokens, 56, "verl")
