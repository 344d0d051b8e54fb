"""Body of the two-process pipeline tests (spawned; results go to a JSON file per rank)."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist

M = 4  # microbatches
SEQ = 16
MBS = 2


def _batches(seed):
    from tests.megatron._models import make_batch

    g = torch.Generator().manual_seed(seed)
    return [make_batch(generator=g, layers=4, seq_len=SEQ) for _ in range(M)]


def _recompute_mismatches(recorder, batches, layer_of):
    """For each router: its REPLAY_BACKWARD calls in order vs the microbatches' routes."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from tests.megatron._models import expected_map

    checked = wrong = 0
    for layer, calls in recorder.calls.items():
        recomputed = [m for action, m in calls if action == RouterReplayAction.REPLAY_BACKWARD]
        for routing_map, mb in zip(recomputed, layer_of(layer, batches)):
            checked += 1
            wrong += not torch.equal(routing_map, expected_map(mb["rollout_expert_indices"][:, :, layer]))
    return checked, wrong


def _schedule_kwargs(forward_step, batches, model):
    return dict(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=M,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )


def run(rank, world_size, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from tests.megatron._models import RouteRecorder, build_model, forward_step
    from torch_r3.megatron import InterleavedPipelineError, ReplayHook
    from torch_r3.megatron._cpu import megatron_on_cpu

    result = {}
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with megatron_on_cpu():
        # --- PP=2, non-interleaved 1F1B, full recompute: replay exact on both stages.
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        torch.manual_seed(0)
        model = build_model(num_layers=4, pipeline_model_parallel_size=2, batch_p2p_comm=False, **recompute)
        # uncaptured="replay": every row, filler included, must come back from the FIFO.
        hook = ReplayHook(model, uncaptured="replay")
        recorder = RouteRecorder(model)
        batches = _batches(seed=3)
        hook.forward_backward(**_schedule_kwargs(forward_step, batches, [model]))
        result["pp_layers"] = list(hook.layers)
        result["pp_checked"], result["pp_wrong"] = _recompute_mismatches(recorder, batches, lambda _layer, b: b)
        result["pp_drained"] = all(r.replay.replay_backward_list == [] for r in hook._routers)
        hook.close()

        # --- The same, with routes holding only this stage's MoE layers (told by L), and
        # with an explicit route_layers= map; a map that lacks this stage's layers is refused.
        stage = list(result["pp_layers"])
        for name, kwargs in (("stage_only", {}), ("route_layers", {"route_layers": stage})):
            recorder.clear()
            hook = ReplayHook(model, uncaptured="replay", **kwargs)
            batches = _batches(seed=5)
            sliced = [
                {**b, "rollout_expert_indices": b["rollout_expert_indices"][:, :, stage].clone()} for b in batches
            ]
            hook.forward_backward(**_schedule_kwargs(forward_step, sliced, [model]))
            result[f"{name}_checked"], result[f"{name}_wrong"] = _recompute_mismatches(
                recorder, batches, lambda _layer, b: b
            )
            hook.close()
        other = [layer for layer in range(4) if layer not in stage]
        try:
            ReplayHook(model, route_layers=other)
        except ValueError as err:
            result["wrong_map"] = str(err)
        hook = ReplayHook(model)
        three = [{**b, "rollout_expert_indices": b["rollout_expert_indices"][:, :, :3]} for b in _batches(seed=5)]
        try:  # this stage's own forward step, outside the schedule: a raise there cannot strand a peer
            with hook.step(forward_only=True):
                hook.wrap_forward_step(forward_step)(iter(three), model)
        except ValueError as err:
            result["wrong_width"] = str(err)
        hook.close()
        recorder.close()
        parallel_state.destroy_model_parallel()

        # --- VPP=2: refused before any step; a naive hook desynchronises.
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
        vpp = dict(
            num_layers=4,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            batch_p2p_comm=False,
            **recompute,
        )
        torch.manual_seed(0)
        chunks = [build_model(vp_stage=v, **vpp) for v in range(2)]
        refusals = []
        # The chunk list; then one chunk whose config hides VPP (parallel_state still knows).
        hidden = dataclasses.replace(chunks[0].config, virtual_pipeline_model_parallel_size=None)
        for target, config in ((chunks, None), (chunks[0], hidden)):
            try:
                ReplayHook(target, config)
            except InterleavedPipelineError as err:
                refusals.append(str(err))
        result["vpp_refusals"] = refusals

        routers = [[m for m in c.modules() if getattr(m, "router_replay", None) is not None] for c in chunks]
        recorders = [RouteRecorder(c) for c in chunks]

        def naive_forward_step(data_iterator, model):
            # Pushes this microbatch into every router of every chunk: what a
            # hook that ignores the chunk structure (or set_replay_data) does.
            batch = next(data_iterator)
            for chunk_routers in routers:
                for r in chunk_routers:
                    idx = batch["rollout_expert_indices"][:, :, r.layer_number - 1].long()
                    r.router_replay.set_target_indices(idx.transpose(0, 1).reshape(-1, idx.shape[-1]))
                    r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            try:
                return forward_step(iter([batch]), model)
            finally:
                for chunk_routers in routers:
                    for r in chunk_routers:
                        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

        batches = _batches(seed=4)
        # The interleaved schedule takes one iterator per chunk; both see the same microbatches.
        kwargs = _schedule_kwargs(naive_forward_step, batches, chunks)
        kwargs["data_iterator"] = [iter(batches), iter(batches)]
        get_forward_backward_func()(**kwargs)
        checked = wrong = 0
        for rec in recorders:
            c, w = _recompute_mismatches(rec, batches, lambda _layer, b: b)
            checked += c
            wrong += w
        result["naive_checked"], result["naive_wrong"] = checked, wrong
        parallel_state.destroy_model_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
