"""`ReplayHook`: install a batch's routes into one Megatron model's routers per microbatch.

It is one class whose per-step state (what each router was given, what
recompute must pop, what was recorded for R2) is read and reset in one place;
the pure parts live elsewhere (`slicing`, `batch_checks`, `setup_checks`,
`routers`), as do each microbatch's layout on this rank (`microbatch`) and
what the hook looks up in the model (`model`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from torch_r3._checks import check_indices
from torch_r3.megatron.batch_checks import check_model_input, check_record_microbatch, check_route_values
from torch_r3.megatron.microbatch import current_rank, prepare_microbatch, rank_share
from torch_r3.megatron.model import (
    as_chunks,
    find_hybrid_pattern,
    find_padding_mask_module,
    first_device,
    model_config,
    stage_layers,
)
from torch_r3.megatron.routers import (
    RouteBuffers,
    RouterTarget,
    check_fifos_drained,
    collect_recorded,
    copy_for_routers,
    expert_bias_mask_is_broken,
    find_routers,
)
from torch_r3.megatron.schedule import MicrobatchSchedule
from torch_r3.megatron.setup_checks import InterleavedPipelineError, check_config, check_pipeline
from torch_r3.megatron.slicing import (
    PACKED_BALANCING,
    RankSlice,
    hybrid_moe_pattern,
    moe_layer_pattern,
)
from torch_r3.replay.checks import check_route_batch
from torch_r3.replay.layers import route_layer_map
from torch_r3.replay.modes import check_uncaptured
from torch_r3.replay.recording import Recording
from torch_r3.replay.stats import ReplayStats, StatsCollector

__all__ = ["InterleavedPipelineError", "ReplayHook"]


class ReplayHook(MicrobatchSchedule):
    """Replays captured routes in one Megatron model's MoE routers, microbatch by microbatch.

    Construct once per model, after the model is built; the set-up is checked
    here, before any step runs. Per training step, either call
    `forward_backward` in place of Megatron's `forward_backward_func`, or wrap
    the call yourself:

    ```python
    with hook.step():
        losses = forward_backward_func(
            forward_step_func=hook.wrap_forward_step(forward_step), ...)
    ```

    A trainer whose forward step cannot be wrapped (it is a closure of the
    trainer's) calls `begin_microbatch(batch)` before its model call and
    `end_microbatch()` after it, inside `step()`.

    Opening a microbatch checks its routes and installs them into this model's
    routers with `REPLAY_FORWARD`; closing it switches the routers to
    `REPLAY_BACKWARD`, so that recompute pops the matching routes. While it is
    open, the model's `forward` gets `padding_mask` (`True` at padding only:
    the batch's `attention_mask == 0`, sliced to this rank) unless the call
    passes one; `router_padding_mask` is read by the routers only. `close()`
    gives the routers Megatron's own methods back.

    Every pipeline stage's `data_iterator` must yield the microbatch dicts (with
    `rollout_expert_indices` and `router_padding_mask`, and `cu_seqlens` for
    the packed layout), even on stages whose forward step reads no tokens: the
    hook takes the microbatch from the iterator itself and hands your forward
    step an iterator that yields that same dict once.

    Each microbatch's routes are checked before any router uses them (expert
    ids in range and distinct per token, one route per token each router sees);
    after each step `last_stats` tells how far the routers would have drifted
    without replay.

    Args:
        model: A Megatron module (`GPTModel`, possibly wrapped in DDP or
            `Float16Module`) or a list holding exactly one model chunk.
        config: The model's `TransformerConfig`; by default the first chunk's
            `.config`.
        uncaptured: What tokens without a captured route (`router_padding_mask`
            True: left padding, the last sampled token, a synthetic EOS) do:
            `"live"` (default) routes them with the router's own top-k, in the
            same router call as the replayed tokens; `"replay"` replays the
            filler routes the batch holds for them.
        route_layers: The global layer (0-based) each index of the routes' `L`
            dimension holds, for routes that carry a subset of the layers.
            Without it the layout is told by `L`: every layer (`num_layers`),
            the MoE layers (their count), or this pipeline stage's MoE layers
            only (their count on this stage, in layer order).
        packed_balancing: How context parallelism splits a packed batch:
            `"per_document"` (Megatron's default with `cu_seqlens`) or
            `"per_sequence"` (its `use_per_sequence_balancing=True`). Other
            modes are refused.
        expert_load: Also count tokens per expert in each layer, from the
            replayed routes and from the router's own choice, into
            `last_stats.rollout_load` / `trainer_load` (off by default: a
            scatter-add per router call, on the routes' device).

    Raises:
        InterleavedPipelineError: When `virtual_pipeline_model_parallel_size` is
            greater than 1 (in `config` or in `parallel_state`), or `model` is
            a list of more than one chunk.
        ValueError: When the configuration bypasses or breaks replay
            (`moe_enable_routing_replay` off, `moe_router_fusion`, sinkhorn
            or quantile-balancing routing, `overlap_moe_expert_parallel_comm`,
            hybrid context parallelism, a CUDA graph that captures the router),
            the model has no router to replay, `uncaptured` is neither
            `"live"` nor `"replay"`, `packed_balancing` names another mode, or
            `route_layers` lacks one of this stage's MoE layers.
        TypeError: When `model` is not a module or a list of modules.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        config: Any | None = None,
        *,
        uncaptured: str = "live",
        route_layers: Sequence[int] | None = None,
        packed_balancing: str = "per_document",
        expert_load: bool = False,
    ):
        super().__init__()
        chunks = as_chunks(model)
        config = model_config(chunks, config)
        check_uncaptured(uncaptured)
        if packed_balancing not in PACKED_BALANCING:
            raise ValueError(
                f"packed_balancing={packed_balancing!r}: this context-parallel partitioning mode is not "
                f"supported (the hook cannot slice routes the way it splits tokens); expected one of "
                f"{PACKED_BALANCING}"
            )
        check_pipeline(config, len(chunks))
        check_config(config)

        self.config = config
        self.uncaptured = uncaptured
        self._chunk = chunks[0]
        self._hybrid = find_hybrid_pattern(self._chunk)
        if self._hybrid is not None:
            # HybridModel: the layer pattern, not moe_layer_freq, says which layers are MoE.
            pp_size = getattr(config, "pipeline_model_parallel_size", 1) or 1
            if pp_size > 1:
                raise ValueError(
                    f"HybridModel with pipeline_model_parallel_size={pp_size}: the hook does not map a "
                    "hybrid pattern's pipeline segments ('|') to stages yet; run HybridModel without "
                    "pipeline parallelism or use GPTModel"
                )
            self._pattern = hybrid_moe_pattern(self._hybrid)
        else:
            self._pattern = moe_layer_pattern(config)
        self._num_experts = config.num_moe_experts
        # One stage for a HybridModel (refused otherwise): every layer of its pattern.
        stage = range(len(self._pattern)) if self._hybrid is not None else stage_layers(self._chunk, config)
        measure_drops = getattr(config, "moe_expert_capacity_factor", None) is not None
        if not isinstance(expert_load, bool):
            raise TypeError(f"expert_load: expected True or False, got {expert_load!r}")
        self._stats = StatsCollector(
            measure_drops=measure_drops, num_experts=self._num_experts if expert_load else None
        )
        self._routers, self._live_routers = find_routers(self._chunk, config, stage.start, self._stats)
        if not self._routers:
            raise ValueError(
                "model: no MoE router with a RouterReplay instance was found; the model must "
                "have MoE layers (num_moe_experts) built with moe_enable_routing_replay=True"
            )
        for r in self._routers:
            r.check_free()
            if r.layer not in stage:
                raise ValueError(
                    f"model: decoder layer {r.layer - stage.start} of this stage holds a router, but "
                    f"the stage has layers {stage.start}..{stage.stop - 1} only"
                )
        self._router_layers = tuple(r.layer for r in self._routers)  # fixed once the model is built
        self._route_layers = (
            None
            if route_layers is None
            else check_indices(route_layers, "route_layers", limit=len(self._pattern), what="layer")
        )
        if self._route_layers is not None:
            route_layer_map(self.router_layers, len(self._route_layers), self._pattern, route_layers=self._route_layers)
        self._packed_balancing = packed_balancing
        self._gpt = find_padding_mask_module(self._chunk)
        self._pre_process = bool(getattr(self._gpt, "pre_process", True))
        # GPTModel's first stage scatters padding_mask for sequence parallelism; HybridModel
        # hands it to its layers as given, so the hook cuts it to this rank's share itself.
        self._model_scatters_mask = self._pre_process and self._hybrid is None
        self._input_shape: tuple[int, int] | None = None
        self._active_mask: torch.Tensor | None = None
        self._record = False
        self._recorded_shapes: list[tuple[int, int, bool, torch.Tensor]] = []  # (B, T, packed, padding)
        self._last_recording: Recording | None = None
        self._last_stats: ReplayStats | None = None
        self._handle = None
        self._buffers = RouteBuffers()  # each microbatch's routes, copied once; reused step after step
        if self._gpt is not None:
            self._handle = self._gpt.register_forward_pre_hook(self._before_model_forward, with_kwargs=True)
        fix_bias = expert_bias_mask_is_broken()
        for r in self._routers:
            r.attach(measure_drops=measure_drops, fix_expert_bias=fix_bias)

    # ----------------------------------------------------------------- public

    @property
    def router_layers(self) -> tuple[int, ...]:
        """Global layer numbers (0-based) of this model's replayed routers, in model order.

        Routers of multi-token prediction layers are not among them: they route live.
        """
        return self._router_layers

    @property
    def layers(self) -> tuple[int, ...]:
        """Alias of `router_layers`."""
        return self.router_layers

    @property
    def last_stats(self) -> ReplayStats | None:
        """The `ReplayStats` of the last step that completed; `None` before the first."""
        return self._last_stats

    @property
    def last_recorded(self) -> list[dict[str, torch.Tensor]] | None:
        """The routes the last recording step's routers chose (R2), one batch-layout dict per microbatch.

        Each dict holds `rollout_expert_indices` (`[B, T, L, K]`, or `[N, L, K]`
        for the packed layout; `L` = this rank's replayed layers, in `layers`
        order, the stage-only layout) and `router_padding_mask` (`True` on
        padding only: every real token was routed and recorded), in microbatch
        order; hand them back in the update step's microbatches. `None` before the
        first recording step. The same list as `last_recording.microbatches`.
        """
        return None if self._last_recording is None else self._last_recording.microbatches

    @property
    def last_recording(self) -> Recording | None:
        """The `Recording` of the last recording step (R2), the type `torch_r3.transformers` records too.

        Its `microbatches` is `last_recorded`; `None` before the first recording step.
        """
        return self._last_recording

    def forward_backward(
        self, forward_backward_func: Callable | None = None, *, record: bool = False, **kwargs: Any
    ) -> Any:
        """Run one training (or evaluation) step of Megatron's schedule with replay.

        Equivalent to `with self.step(forward_only=..., num_microbatches=..., record=...)`
        around `forward_backward_func(forward_step_func=self.wrap_forward_step(fn), **rest)`.

        Args:
            forward_backward_func: Megatron's schedule function; by default
                `get_forward_backward_func()` for the current parallel state.
            record: Record the routers' own choice instead of replaying (R2, with
                `forward_only=True`); the routes are in `last_recorded` after the step.
            **kwargs: The schedule's keyword arguments, including
                `forward_step_func` (your unwrapped forward step).

        Returns:
            Whatever the schedule returns (the per-microbatch loss reductions).
        """
        return self._run_schedule(forward_backward_func, kwargs, record=record)

    def record(self, *, num_microbatches: int | None = None) -> contextlib.AbstractContextManager[ReplayHook]:
        """A forward-only step that records the routers' own routes instead of replaying (R2).

        For inference engines that return no routes: run the old-log-prob
        forward pass inside it, then replay `last_recorded` in the update step
        through the same path as captured routes. The microbatches need no
        routes; their token layout comes from `attention_mask` or `input_ids`
        (`cu_seqlens` for the packed layout).

        Raises:
            ValueError: Under context parallelism or sequence parallelism, where
                a rank routes only a share of each sequence.
        """
        return self.step(forward_only=True, num_microbatches=num_microbatches, record=True)

    @contextlib.contextmanager
    def step(
        self, *, forward_only: bool = False, num_microbatches: int | None = None, record: bool = False
    ) -> Iterator[ReplayHook]:
        """Bracket one `forward_backward` call: clear replay state before and after.

        On a clean exit it checks every router's backward FIFO (routers that
        activation recompute re-runs must have popped exactly one entry per
        microbatch, the others must hold exactly one entry per microbatch;
        anything else means recompute replayed the wrong routes) and sets
        `last_stats`.

        Args:
            forward_only: Pass the schedule's `forward_only`; no backward runs, so
                no FIFO entry is expected to be popped.
            num_microbatches: The schedule's `num_microbatches`, named in the
                error when the data iterator runs out.
            record: Record instead of replay (see `record`); needs `forward_only=True`.

        Raises:
            RuntimeError: When a FIFO was not drained exactly, a router ran
                without consulting replay, or steps are nested.
            ValueError: When recording is asked for a training step, or under
                context or sequence parallelism.
        """
        self._check_can_step()
        if record:
            self._check_can_record(forward_only)
        self._record = record
        try:
            with self._stepping(forward_only=forward_only, num_microbatches=num_microbatches):
                yield self
        finally:
            self._record = False

    # --------------------------------------------------------------- internals

    @property
    def _closed(self) -> bool:
        return self._handle is None and self._gpt is not None

    def _finish_microbatch(self) -> None:
        # Recompute pops the routes this microbatch's forward used.
        self._active_mask = None
        for r in self._routers:
            r.replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            r.current = None

    def _finish_step(self) -> None:
        self._check_drained()
        self._last_stats = self._stats.finish(self.router_layers)
        if self._record:
            self._last_recording = Recording(collect_recorded(self._routers, self._recorded_shapes, self._num_experts))

    def _detach(self) -> None:
        # The routers get Megatron's own methods back.
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for r in self._routers:
            r.detach()
        self._reset()
        self._buffers.release()

    def _rank(self) -> RankSlice:
        return current_rank(self.config)

    def _install(self, batch: Mapping[str, Any], microbatch: int) -> None:
        live = self.uncaptured == "live"
        # Each tensor goes to the model's device once, as the batch holds it (non-blocking:
        # asynchronous from pinned memory); the checks, layer selection and slicing run there.
        device = first_device(self._chunk)  # asked per call: models move after construction
        if self._record:
            (b, t), cu_seqlens = check_record_microbatch(batch)
            shape = (t,) if cu_seqlens is not None else (b, t)
            mask = torch.zeros(shape, dtype=torch.bool, device=device)
            routes = torch.zeros((*shape, 1, 1), dtype=torch.uint8, device=device)  # shape only
            index: list[int] = []
        else:
            routes, mask, cu_seqlens = check_route_batch(batch, self.config.moe_router_topk, what="microbatch")
            # Map every router before touching any FIFO, so a bad L leaves no half-installed state.
            index = route_layer_map(
                self.router_layers, routes.shape[-2], self._pattern, route_layers=self._route_layers
            )
            routes = routes.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            if index != list(range(routes.shape[-2])):
                routes = routes[..., index, :]
        layout = prepare_microbatch(batch, mask, cu_seqlens, microbatch=microbatch, layer=self.router_layers[0])
        if not self._record:
            layers = [(r.layer, j) for j, r in enumerate(self._routers)]  # (global layer, index into routes)
            check_route_values(
                routes,
                ~mask if live else torch.ones_like(mask),
                layers,
                self._num_experts,
                microbatch=microbatch,
                cu_seqlens=layout.offsets,
                uncaptured=mask,
            )
        share = rank_share(
            routes,
            mask,
            layout,
            self._rank(),
            model_scatters_mask=self._model_scatters_mask,
            packed_balancing=self._packed_balancing,
        )
        routes = share.routes
        # One copy the hook owns (a caller refilling its batch cannot change what recompute replays),
        # each router's rows contiguous: compact where the router call widens them (live), else int64.
        owned = None
        if not self._record:
            b, s, j, k = routes.shape
            buffer = self._buffers.take(microbatch, (j, s, b, k), routes.dtype if live else torch.int64, routes.device)
            owned = copy_for_routers(buffer, routes)
        self._input_shape = share.input_shape
        uncaptured = share.uncaptured
        grad = torch.is_grad_enabled()
        # Each router's view in one call (indexing `owned[j]` per router costs as much as a small copy).
        per_router: Sequence[torch.Tensor | None] = [None] * len(self._routers) if owned is None else owned.unbind(0)
        for r, indices in zip(self._routers, per_router, strict=True):
            target = RouterTarget(
                indices=indices,
                uncaptured=uncaptured,
                live=live,
                microbatch=microbatch,
                batch_rows=routes.shape[0],
                record=self._record,
            )
            r.push(target, expect_pop=r.recomputed and grad and r.module.training and not self._forward_only)
        if self._record:
            self._recorded_shapes.append(
                (routes.shape[0], routes.shape[1], cu_seqlens is not None, layout.padding_mask)
            )
        else:
            self._stats.add_microbatch(uncaptured, live=live, padding=share.padding)
        self._active_mask = share.model_mask

    def _check_can_record(self, forward_only: bool) -> None:
        if not forward_only:
            raise ValueError(
                "record=True: recording routes is a forward-only pass (the old-log-prob pass); "
                "pass forward_only=True and replay last_recorded in the training step"
            )
        rank = self._rank()
        if rank.cp_size > 1 or rank.splits_sequence:
            raise ValueError(
                f"record=True under context parallelism (size {rank.cp_size}) or sequence parallelism "
                f"(tensor parallel size {rank.tp_size}): each rank routes only a share of each sequence, "
                "so no rank holds the whole microbatch's routes to hand back"
            )

    def _before_model_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._active_mask is None:
            return None
        if self._pre_process and kwargs.get("decoder_input") is None:
            ids = args[0] if args else kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor):
                check_model_input(
                    self._input_shape,  # type: ignore[arg-type]  # set with _active_mask, checked above
                    ids.shape,
                    microbatch=self._microbatch - 1,
                    layer=self._routers[0].layer,
                )
        if kwargs.get("padding_mask") is not None:
            return None
        return args, {**kwargs, "padding_mask": self._active_mask}

    def _clear(self) -> None:
        self._active_mask = None
        self._recorded_shapes = []
        self._stats.reset()
        for r in self._routers:
            r.clear()
        for router in self._live_routers:  # MTP routers: no replay action, their own top-k
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    def _check_drained(self) -> None:
        check_fifos_drained(self._routers)
