"""`ReplayHook`: install a batch's routes into one Megatron model's routers per microbatch."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from torch_r3.megatron.setup_checks import InterleavedPipelineError, check_config, check_pipeline
from torch_r3.megatron.routers import RouterTarget, find_routers
from torch_r3.megatron.slicing import (
    RankSlice,
    moe_layer_pattern,
    route_layer_index,
    router_indices,
    sequence_parallel_positions,
    slice_for_rank,
    stage_layer_range,
)
from torch_r3.stats import ReplayStats, StatsCollector
from torch_r3.megatron.batch_checks import check_microbatch, check_model_input, check_route_values

__all__ = ["InterleavedPipelineError", "ReplayHook"]

_UNCAPTURED = ("live", "replay")


class ReplayHook:
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

    Raises:
        InterleavedPipelineError: When `virtual_pipeline_model_parallel_size` is
            greater than 1 (in `config` or in `parallel_state`), or `model` is
            a list of more than one chunk.
        ValueError: When the configuration bypasses or breaks replay
            (`moe_enable_routing_replay` off, `moe_router_fusion`, sinkhorn
            routing, `overlap_moe_expert_parallel_comm`, a CUDA graph that
            captures the router), the model has no router to replay, or
            `uncaptured` is neither `"live"` nor `"replay"`.
        TypeError: When `model` is not a module or a list of modules.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        config: Optional[Any] = None,
        *,
        uncaptured: str = "live",
    ):
        chunks = _as_chunks(model)
        if config is None:
            config = getattr(chunks[0], "config", None)
            if config is None:
                raise TypeError("config: the model has no .config; pass its TransformerConfig as config=")
        if uncaptured not in _UNCAPTURED:
            raise ValueError(f"uncaptured: expected 'live' or 'replay', got {uncaptured!r}")
        check_pipeline(config, len(chunks))
        check_config(config)

        self.config = config
        self.uncaptured = uncaptured
        self._chunk = chunks[0]
        self._pattern = moe_layer_pattern(config)
        self._num_experts = config.num_moe_experts
        stage = self._stage_layers(config)
        measure_drops = getattr(config, "moe_expert_capacity_factor", None) is not None
        self._stats = StatsCollector(measure_drops=measure_drops)
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
        self._gpt = _find_padding_mask_module(self._chunk)
        self._pre_process = bool(getattr(self._gpt, "pre_process", True))
        self._active_mask: Optional[torch.Tensor] = None
        self._microbatch = 0
        self._num_microbatches: Optional[int] = None
        self._in_step = False
        self._forward_only = False
        self._last_stats: Optional[ReplayStats] = None
        self._handle = None
        if self._gpt is not None:
            self._handle = self._gpt.register_forward_pre_hook(self._before_model_forward, with_kwargs=True)
        for r in self._routers:
            r.attach(measure_drops=measure_drops)

    # ----------------------------------------------------------------- public

    @property
    def layers(self) -> tuple[int, ...]:
        """Global layer numbers (0-based) of this model's replayed routers, in model order.

        Routers of multi-token prediction layers are not among them: they route live.
        """
        return tuple(r.layer for r in self._routers)

    @property
    def last_stats(self) -> Optional[ReplayStats]:
        """The `ReplayStats` of the last step that completed; `None` before the first."""
        return self._last_stats

    def forward_backward(self, forward_backward_func: Optional[Callable] = None, **kwargs: Any) -> Any:
        """Run one training (or evaluation) step of Megatron's schedule with replay.

        Equivalent to `with self.step(forward_only=..., num_microbatches=...)`
        around `forward_backward_func(forward_step_func=self.wrap_forward_step(fn), **rest)`.

        Args:
            forward_backward_func: Megatron's schedule function; by default
                `get_forward_backward_func()` for the current parallel state.
            **kwargs: The schedule's keyword arguments, including
                `forward_step_func` (your unwrapped forward step).

        Returns:
            Whatever the schedule returns (the per-microbatch loss reductions).
        """
        if "forward_step_func" not in kwargs:
            raise TypeError("forward_backward: forward_step_func= is required")
        if forward_backward_func is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            forward_backward_func = get_forward_backward_func()
        kwargs["forward_step_func"] = self.wrap_forward_step(kwargs["forward_step_func"])
        with self.step(
            forward_only=bool(kwargs.get("forward_only", False)),
            num_microbatches=kwargs.get("num_microbatches"),
        ):
            return forward_backward_func(**kwargs)

    @contextlib.contextmanager
    def step(self, *, forward_only: bool = False, num_microbatches: Optional[int] = None) -> Iterator["ReplayHook"]:
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

        Raises:
            RuntimeError: When a FIFO was not drained exactly, or steps are nested.
        """
        if self._in_step:
            raise RuntimeError("ReplayHook.step() is already active; steps do not nest")
        self._in_step = True
        self._forward_only = forward_only
        self._num_microbatches = num_microbatches
        self._clear()
        try:
            yield self
            self._check_drained()
            self._last_stats = self._stats.finish(self.layers)
        finally:
            self._clear()
            self._in_step = False

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Wrap a Megatron `forward_step_func(data_iterator, model)` to replay routes.

        For each microbatch the wrapper takes the next dict from
        `data_iterator`, checks its routes, installs them into this model's
        routers with `REPLAY_FORWARD`, calls `forward_step_func` with an
        iterator that yields that dict once, and switches the routers to
        `REPLAY_BACKWARD` as soon as it returns, so that recompute pops the
        matching routes. While it runs, the model's `forward` gets
        `padding_mask` (the batch's `router_padding_mask`, sliced to this
        rank) unless the call passes one.

        Args:
            forward_step_func: Your forward step, Megatron's signature.

        Returns:
            The wrapped forward step; its signature looks like yours to Megatron.

        Raises:
            ValueError: When the data iterator runs out before the schedule's
                last microbatch, or a microbatch's routes are invalid.
            RuntimeError: When `forward_step_func` reads more than one
                microbatch from its iterator.
        """
        if not callable(forward_step_func):
            raise TypeError(f"forward_step_func: expected a callable, got {type(forward_step_func).__name__}")

        @functools.wraps(forward_step_func)
        def replaying_forward_step(data_iterator, model, *args, **kwargs):
            if not self._in_step:
                raise RuntimeError(
                    "the replaying forward step ran outside ReplayHook.step(); use "
                    "hook.forward_backward(...) or `with hook.step(): ...`"
                )
            if data_iterator is None:
                raise TypeError(
                    "data_iterator is None on this pipeline stage; with ReplayHook every "
                    "stage's data_iterator must yield the microbatch dicts (they carry the routes)"
                )
            if isinstance(data_iterator, (list, tuple)):
                raise TypeError(
                    "data_iterator: expected one iterator, got a list (interleaved schedules are not supported)"
                )
            batch = self._next_microbatch(data_iterator)
            self._install(batch)
            try:
                return forward_step_func(iter((batch,)), model, *args, **kwargs)
            except StopIteration as err:  # would silently end a caller's for loop
                raise RuntimeError(
                    f"forward_step_func called next() on the data iterator more than once for "
                    f"microbatch {self._microbatch - 1}; with ReplayHook it yields exactly the one "
                    "microbatch whose routes are installed"
                ) from err
            finally:
                self._active_mask = None
                for r in self._routers:
                    r.replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                    r.current = None

        return replaying_forward_step

    def __enter__(self) -> "ReplayHook":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hook from the model and clear this model's replay state.

        The routers get Megatron's own methods back. The hook is also a context
        manager: `with ReplayHook(model) as hook:` closes it on exit.
        """
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for r in self._routers:
            r.detach()
        self._clear()

    # --------------------------------------------------------------- internals

    def _stage_layers(self, config) -> range:
        pp_size = getattr(config, "pipeline_model_parallel_size", 1) or 1
        vp_stage = getattr(self._chunk, "vp_stage", None)
        if parallel_state.model_parallel_is_initialized():
            return stage_layer_range(config, vp_stage=vp_stage)
        if pp_size > 1:
            raise ValueError(
                f"config.pipeline_model_parallel_size={pp_size} but Megatron's parallel_state is "
                "not initialized; cannot tell which layers this pipeline stage holds"
            )
        return stage_layer_range(config, vp_stage=vp_stage, pp_rank=0)

    def _next_microbatch(self, data_iterator):
        try:
            return next(data_iterator)
        except StopIteration:
            arrived = self._microbatch
            if self._num_microbatches is not None:
                raise ValueError(
                    f"data_iterator ran out: the schedule asked for {self._num_microbatches} "
                    f"microbatches, {arrived} arrived"
                ) from None
            which = f"{arrived + 1} (the first), none arrived" if arrived == 0 else f"{arrived + 1}, {arrived} arrived"
            raise ValueError(f"data_iterator ran out: the schedule asked for microbatch {which}") from None

    def _rank(self) -> RankSlice:
        sp = bool(getattr(self.config, "sequence_parallel", False))
        if not parallel_state.model_parallel_is_initialized():
            return RankSlice(sequence_parallel=sp)
        return RankSlice(
            cp_size=parallel_state.get_context_parallel_world_size(),
            cp_rank=parallel_state.get_context_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sequence_parallel=sp,
        )

    def _install(self, batch) -> None:
        microbatch = self._microbatch
        self._microbatch += 1
        routes, mask, cu_seqlens = check_microbatch(batch, self.config.moe_router_topk)
        # Map every router before touching any FIFO, so a bad L leaves no half-installed state.
        index = [route_layer_index(r.layer, routes.shape[-2], self._pattern) for r in self._routers]
        if index != list(range(routes.shape[-2])):
            # Only this stage's MoE layers are checked, sliced and copied to the device.
            routes = routes[..., index, :]
        layers = [(r.layer, j) for j, r in enumerate(self._routers)]  # (global layer, index into routes)
        live = self.uncaptured == "live"
        check_route_values(
            routes,
            ~mask if live else torch.ones_like(mask),
            layers,
            self._num_experts,
            microbatch=microbatch,
            cu_seqlens=cu_seqlens,
        )
        rank = self._rank()
        # Only the first stage's GPTModel scatters padding_mask for sequence
        # parallelism; later stages hand it to the MoE layers as given.
        routes, model_mask = slice_for_rank(
            routes, mask, rank, cu_seqlens=cu_seqlens, model_scatters_mask=self._pre_process
        )
        # One host-to-device copy for all layers, widened to int64 because the
        # router gathers and scatters with these indices (uint8/int16 would not index);
        # one copy of the mask, from which the routers' view is cut on the device.
        device = _first_device(self._chunk)  # asked per call: models move after construction
        local = routes.to(device=device, dtype=torch.int64, non_blocking=True)
        model_mask = model_mask.to(device, non_blocking=True)
        router_mask = model_mask
        if self._pre_process and rank.splits_sequence:
            router_mask = model_mask[:, sequence_parallel_positions(model_mask.shape[1], rank.tp_size, rank.tp_rank)]
        uncaptured = router_mask.transpose(0, 1).reshape(-1)
        grad = torch.is_grad_enabled()
        for r, (_, j) in zip(self._routers, layers):
            target = RouterTarget(
                indices=router_indices(local, j).contiguous(),
                uncaptured=uncaptured,
                live=live,
                microbatch=microbatch,
                batch_rows=local.shape[0],
            )
            r.push(target, expect_pop=r.recomputed and grad and r.module.training and not self._forward_only)
        self._stats.add_microbatch(uncaptured, live=live)
        self._active_mask = model_mask

    def _before_model_forward(self, module, args, kwargs):
        if self._active_mask is None:
            return None
        if self._pre_process and kwargs.get("decoder_input") is None:
            ids = args[0] if args else kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor):
                check_model_input(
                    self._active_mask.shape, ids.shape, microbatch=self._microbatch - 1, layer=self._routers[0].layer
                )
        if kwargs.get("padding_mask") is not None:
            return None
        return args, {**kwargs, "padding_mask": self._active_mask}

    def _clear(self) -> None:
        self._active_mask = None
        self._microbatch = 0
        self._stats.reset()
        for r in self._routers:
            r.clear()
        for router in self._live_routers:  # MTP routers: no replay action, their own top-k
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    def _check_drained(self) -> None:
        wrong = []
        for r in self._routers:
            left = len(r.replay.replay_backward_list)
            expected = r.pushes - r.expected_pops
            if left != expected:
                wrong.append(
                    f"layer {r.layer}: {left} routes left in the backward FIFO after "
                    f"{r.pushes} forwards, expected {expected}"
                )
        if wrong:
            raise RuntimeError(
                "router replay FIFOs out of step after forward_backward (recompute replayed "
                "the wrong microbatch's routes or skipped some): " + "; ".join(wrong)
            )


def _as_chunks(model: Any) -> list[torch.nn.Module]:
    """A model or a list of model chunks as a list of modules.

    Raises:
        ValueError: When the list is empty.
        TypeError: When an element is not a `torch.nn.Module`.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("model: got an empty list of model chunks")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"model[{i}]: expected a torch.nn.Module, got {type(chunk).__name__}")
    return chunks


def _find_padding_mask_module(chunk: torch.nn.Module) -> Optional[torch.nn.Module]:
    # DDP and Float16Module keep the model in .module; the innermost module whose
    # forward takes padding_mask (GPTModel in megatron-core >= 0.16) gets it.
    module = chunk
    found = None
    for _ in range(8):
        try:
            if "padding_mask" in inspect.signature(module.forward).parameters:
                found = module
        except (TypeError, ValueError):
            pass
        inner = getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return found


def _first_device(chunk: torch.nn.Module) -> torch.device:
    for p in chunk.parameters():
        return p.device
    return torch.device("cpu")
