"""``ReplayHook``: install a batch's routes into one Megatron model's routers per microbatch."""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from torch_r3.megatron.slicing import (
    RankSlice,
    moe_layer_pattern,
    route_layer_index,
    router_indices,
    slice_for_rank,
    stage_layer_range,
)

__all__ = ["InterleavedPipelineError", "ReplayHook"]

ROUTES_KEY = "rollout_expert_indices"
MASK_KEY = "router_padding_mask"
CU_SEQLENS_KEY = "cu_seqlens"

_ROUTE_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


class InterleavedPipelineError(ValueError):
    """The model uses the interleaved (virtual pipeline) schedule, which replay cannot follow.

    Megatron's interleaved 1F1B schedule runs the forwards of several model chunks
    before their backwards, in an order where one microbatch's forward feeds the
    routers of one chunk while recompute pops the routers of another. The
    per-router replay FIFOs then fall out of step and recompute silently replays
    another microbatch's routes.
    """


@dataclass
class _Router:
    """One of this model's MoE routers and what the hook tracks about it."""

    replay: RouterReplay
    module: torch.nn.Module
    layer: int  # global, 0-based
    recomputed: bool  # does activation recompute re-run this router in backward?
    pushes: int = 0
    expected_pops: int = 0


class ReplayHook:
    """Replays captured routes in one Megatron model's MoE routers, microbatch by microbatch.

    Construct once per model, after the model is built; the set-up is validated
    here, before any step runs. Per training step, either call
    :meth:`forward_backward` in place of Megatron's ``forward_backward_func``, or
    wrap the call yourself::

        with hook.step():
            losses = forward_backward_func(
                forward_step_func=hook.wrap_forward_step(forward_step), ...)

    Every pipeline stage's ``data_iterator`` must yield the microbatch dicts (with
    ``rollout_expert_indices`` and ``router_padding_mask``, and ``cu_seqlens`` for
    the packed layout), even on stages whose forward step reads no tokens: the
    hook takes the microbatch from the iterator itself and hands your forward
    step an iterator that yields that same dict once.

    Args:
        model: A Megatron module (``GPTModel``, possibly wrapped in DDP or
            ``Float16Module``) or a list holding exactly one model chunk.
        config: The model's ``TransformerConfig``; by default the first chunk's
            ``.config``.

    Raises:
        InterleavedPipelineError: When ``virtual_pipeline_model_parallel_size`` is
            greater than 1 (in ``config`` or in ``parallel_state``), or ``model`` is
            a list of more than one chunk.
        ValueError: When ``moe_enable_routing_replay`` is off, ``moe_router_fusion``
            is on, the routers use sinkhorn load balancing, or the model has no
            router with a ``RouterReplay`` instance.
        TypeError: When ``model`` is not a module or a list of modules.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], config: Optional[Any] = None):
        chunks = _as_chunks(model)
        if config is None:
            config = getattr(chunks[0], "config", None)
            if config is None:
                raise TypeError(
                    "config: the model has no .config; pass its TransformerConfig as config="
                )
        _check_pipeline(config, len(chunks))
        _check_config(config)

        self.config = config
        self._chunk = chunks[0]
        self._pattern = moe_layer_pattern(config)
        self._routers = _find_routers(self._chunk, config)
        if not self._routers:
            raise ValueError(
                "model: no MoE router with a RouterReplay instance was found; the model must "
                "have MoE layers (num_moe_experts) built with moe_enable_routing_replay=True"
            )
        self._check_stage(config)
        self._gpt = _find_padding_mask_module(self._chunk)
        self._pre_process = bool(getattr(self._gpt, "pre_process", True))
        self._active_mask: Optional[torch.Tensor] = None
        self._in_step = False
        self._handle = None
        if self._gpt is not None:
            self._handle = self._gpt.register_forward_pre_hook(
                self._hand_padding_mask, with_kwargs=True
            )

    # ----------------------------------------------------------------- public

    @property
    def layers(self) -> tuple[int, ...]:
        """Global layer numbers (0-based) of this model's routers, in model order."""
        return tuple(r.layer for r in self._routers)

    def forward_backward(self, forward_backward_func: Optional[Callable] = None, **kwargs: Any) -> Any:
        """Run one training (or evaluation) step of Megatron's schedule with replay.

        Equivalent to ``with self.step(forward_only=...)`` around
        ``forward_backward_func(forward_step_func=self.wrap_forward_step(fn), **rest)``.

        Args:
            forward_backward_func: Megatron's schedule function; by default
                ``get_forward_backward_func()`` for the current parallel state.
            **kwargs: The schedule's keyword arguments, including
                ``forward_step_func`` (your unwrapped forward step).

        Returns:
            Whatever the schedule returns (the per-microbatch loss reductions).
        """
        if "forward_step_func" not in kwargs:
            raise TypeError("forward_backward: forward_step_func= is required")
        if forward_backward_func is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            forward_backward_func = get_forward_backward_func()
        kwargs["forward_step_func"] = self.wrap_forward_step(kwargs["forward_step_func"])
        with self.step(forward_only=bool(kwargs.get("forward_only", False))):
            return forward_backward_func(**kwargs)

    @contextlib.contextmanager
    def step(self, *, forward_only: bool = False) -> Iterator["ReplayHook"]:
        """Bracket one ``forward_backward`` call: clear replay state before and after.

        On a clean exit it also checks every router's backward FIFO: routers that
        activation recompute re-runs must have popped exactly one entry per
        microbatch (nothing left over), the others must hold exactly one entry per
        microbatch. Anything else means recompute replayed the wrong routes.

        Args:
            forward_only: Pass the schedule's ``forward_only``; no backward runs, so
                no FIFO entry is expected to be popped.

        Raises:
            RuntimeError: When a FIFO was not drained exactly, or steps are nested.
        """
        if self._in_step:
            raise RuntimeError("ReplayHook.step() is already active; steps do not nest")
        self._in_step = True
        self._forward_only = forward_only
        self._clear()
        try:
            yield self
            self._check_drained()
        finally:
            self._clear()
            self._in_step = False

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Wrap a Megatron ``forward_step_func(data_iterator, model)`` to replay routes.

        For each microbatch the wrapper takes the next dict from
        ``data_iterator``, installs its routes into this model's routers with
        ``REPLAY_FORWARD``, calls ``forward_step_func`` with an iterator that
        yields that dict once, and switches the routers to ``REPLAY_BACKWARD``
        as soon as it returns, so that recompute pops the matching routes. While
        it runs, the model's ``forward`` gets ``padding_mask`` (the batch's
        ``router_padding_mask``, sliced to this rank) unless the call passes one.

        Args:
            forward_step_func: Your forward step, Megatron's signature.

        Returns:
            The wrapped forward step; its signature looks like yours to Megatron.
        """
        if not callable(forward_step_func):
            raise TypeError(
                f"forward_step_func: expected a callable, got {type(forward_step_func).__name__}"
            )

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
                    "data_iterator: expected one iterator, got a list (interleaved schedules "
                    "are not supported)"
                )
            batch = next(data_iterator)
            self._install(batch)
            try:
                return forward_step_func(iter((batch,)), model, *args, **kwargs)
            finally:
                self._active_mask = None
                self._set_action(RouterReplayAction.REPLAY_BACKWARD)

        return replaying_forward_step

    def local_padding_mask(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The ``padding_mask`` this rank's model gets for a microbatch.

        ``[B, S]`` (padded layout) or ``[1, N]`` (packed layout), ``True`` where the
        token has no captured route, already sliced for context parallelism (and
        for sequence parallelism on stages that do not scatter it themselves).
        """
        return self._slice(batch)[1]

    def __enter__(self) -> "ReplayHook":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the forward pre-hook and clear this model's replay state.

        The hook is also a context manager: ``with ReplayHook(model) as hook:``
        closes it on exit.
        """
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._clear()

    # --------------------------------------------------------------- internals

    def _check_stage(self, config) -> None:
        pp_size = getattr(config, "pipeline_model_parallel_size", 1) or 1
        pp_rank = None if parallel_state.model_parallel_is_initialized() else 0
        if pp_size > 1 and pp_rank == 0:
            return  # no parallel state to ask which stage this is
        stage = stage_layer_range(config, vp_stage=getattr(self._chunk, "vp_stage", None), pp_rank=pp_rank)
        for r in self._routers:
            if r.layer not in stage:
                raise ValueError(
                    f"model: a router reports global layer {r.layer}, outside this pipeline "
                    f"stage's layers {stage.start}..{stage.stop - 1}; layer numbering is inconsistent"
                )

    def _rank(self) -> RankSlice:
        if not parallel_state.model_parallel_is_initialized():
            return RankSlice(sequence_parallel=bool(getattr(self.config, "sequence_parallel", False)))
        return RankSlice(
            cp_size=parallel_state.get_context_parallel_world_size(),
            cp_rank=parallel_state.get_context_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sequence_parallel=bool(getattr(self.config, "sequence_parallel", False)),
        )

    def _slice(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate a microbatch and cut it to this rank: (routes [B, S, L, K], model mask)."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"microbatch: expected a dict, got {type(batch).__name__}")
        for key in (ROUTES_KEY, MASK_KEY):
            if key not in batch:
                raise ValueError(f"microbatch: missing key {key!r}")
        routes, mask = batch[ROUTES_KEY], batch[MASK_KEY]
        if not isinstance(routes, torch.Tensor) or routes.dtype not in _ROUTE_DTYPES:
            what = routes.dtype if isinstance(routes, torch.Tensor) else type(routes).__name__
            raise TypeError(
                f"{ROUTES_KEY}: expected a uint8/int16/int32/int64 torch.Tensor, got {what}"
            )
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"{MASK_KEY}: expected a torch.bool tensor, got {what}")
        topk = self.config.moe_router_topk
        rank = self._rank()
        packed = CU_SEQLENS_KEY in batch and batch[CU_SEQLENS_KEY] is not None
        if packed:
            if routes.ndim != 3 or routes.shape[-1] != topk:
                raise ValueError(
                    f"{ROUTES_KEY}: packed layout expects [sum(n), L, K={topk}], "
                    f"got {list(routes.shape)}"
                )
            if mask.shape != routes.shape[:1]:
                raise ValueError(
                    f"{MASK_KEY}: packed layout expects [{routes.shape[0]}], got {list(mask.shape)}"
                )
        else:
            if routes.ndim != 4 or routes.shape[-1] != topk:
                raise ValueError(
                    f"{ROUTES_KEY}: padded layout expects [B, T, L, K={topk}] (or [sum(n), L, K] "
                    f"with {CU_SEQLENS_KEY!r}), got {list(routes.shape)}"
                )
            if mask.shape != routes.shape[:2]:
                raise ValueError(
                    f"{MASK_KEY}: expected [B, T] = {list(routes.shape[:2])}, got {list(mask.shape)}"
                )
        # Only the first stage's GPTModel scatters padding_mask for sequence
        # parallelism; later stages hand it to the MoE layers as given.
        return slice_for_rank(
            routes,
            mask,
            rank,
            cu_seqlens=batch[CU_SEQLENS_KEY] if packed else None,
            model_scatters_mask=self._pre_process,
        )

    def _install(self, batch) -> None:
        routes, mask = self._slice(batch)
        # Map every router before touching any FIFO, so a bad L leaves no half-installed state.
        indices = [route_layer_index(r.layer, routes.shape[2], self._pattern) for r in self._routers]
        # One host-to-device copy for all layers, widened to int64 because the
        # router gathers and scatters with these indices (uint8/int16 would not index).
        device = _first_device(self._chunk)  # asked per call: models move after construction
        local = routes.to(device=device, dtype=torch.int64, non_blocking=True)
        grad = torch.is_grad_enabled()
        for r, index in zip(self._routers, indices):
            r.replay.set_target_indices(router_indices(local, index).contiguous())
            r.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            r.pushes += 1
            if r.recomputed and grad and r.module.training and not self._forward_only:
                r.expected_pops += 1
        self._active_mask = mask.to(device, non_blocking=True)

    def _hand_padding_mask(self, module, args, kwargs):
        if self._active_mask is None or kwargs.get("padding_mask") is not None:
            return None
        return args, {**kwargs, "padding_mask": self._active_mask}

    def _set_action(self, action) -> None:
        for r in self._routers:
            r.replay.set_router_replay_action(action)

    def _clear(self) -> None:
        self._active_mask = None
        for r in self._routers:
            r.replay.clear_indices()
            r.replay.clear_router_replay_action()
            r.pushes = 0
            r.expected_pops = 0

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


# ---------------------------------------------------------------- validation


def _as_chunks(model) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("model: got an empty list of model chunks")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"model[{i}]: expected a torch.nn.Module, got {type(chunk).__name__}")
    return chunks


_VPP_ADVICE = (
    "Megatron's interleaved schedule runs several chunks' forwards before their "
    "backwards, so every router's replay FIFO receives microbatches in a different order "
    "than activation recompute pops them, and recompute silently replays another "
    "microbatch's routes. Build the model as one chunk per pipeline stage "
    "(virtual_pipeline_model_parallel_size=None or 1) and use the non-interleaved 1F1B "
    "schedule."
)


def _check_pipeline(config, num_chunks: int) -> None:
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None and vpp > 1:
        raise InterleavedPipelineError(
            f"config.virtual_pipeline_model_parallel_size={vpp}: router replay cannot run "
            f"under the interleaved pipeline schedule. {_VPP_ADVICE}"
        )
    if parallel_state.model_parallel_is_initialized():
        state_vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if state_vpp is not None and state_vpp > 1:
            raise InterleavedPipelineError(
                f"parallel_state virtual pipeline size is {state_vpp} (initialize_model_parallel"
                f"(virtual_pipeline_model_parallel_size=...)): router replay cannot run under "
                f"the interleaved pipeline schedule. {_VPP_ADVICE}"
            )
    if num_chunks > 1:
        raise InterleavedPipelineError(
            f"model: got {num_chunks} model chunks; more than one chunk per stage means the "
            f"interleaved pipeline schedule. {_VPP_ADVICE}"
        )


def _check_config(config) -> None:
    if not getattr(config, "moe_enable_routing_replay", False):
        raise ValueError(
            "config.moe_enable_routing_replay is False: Megatron creates no RouterReplay "
            "instances; build the model with moe_enable_routing_replay=True"
        )
    if getattr(config, "moe_router_fusion", False):
        raise ValueError(
            "config.moe_router_fusion is True: Megatron's fused router bypasses replay; "
            "set moe_router_fusion=False"
        )
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        raise ValueError(
            "config.moe_router_load_balancing_type is 'sinkhorn': sinkhorn routing bypasses "
            "replay; use 'aux_loss', 'seq_aux_loss' or 'none'"
        )


def _layer_number(router: torch.nn.Module, replay: RouterReplay, name: str) -> int:
    # Newer megatron-core (0.17+) records the layer on RouterReplay itself; 0.16
    # only on the router (TopKRouter.set_layer_number). Both are global and 1-based.
    for owner in (replay, router):
        number = getattr(owner, "layer_number", None)
        if isinstance(number, int) and not isinstance(number, bool):
            return number - 1
    raise ValueError(f"model: router {name!r} has no layer_number; cannot map it to routes")


def _find_routers(chunk: torch.nn.Module, config) -> list[_Router]:
    granularity = getattr(config, "recompute_granularity", None)
    modules = getattr(config, "recompute_modules", None) or ()
    method = getattr(config, "recompute_method", None)
    selective_moe = (
        granularity == "selective"
        and "moe" in modules
        and getattr(config, "cuda_graph_impl", "none") != "local"
    )
    found = []
    for name, module in chunk.named_modules():
        replay = getattr(module, "router_replay", None)
        if not isinstance(replay, RouterReplay):
            continue
        layer = _layer_number(module, replay, name)
        recomputed = selective_moe
        if granularity == "full":
            if method == "block":
                local = _local_layer_index(name)
                recomputed = local is not None and local < (config.recompute_num_layers or 0)
            else:
                recomputed = True
        found.append(_Router(replay=replay, module=module, layer=layer, recomputed=recomputed))
    return found


def _local_layer_index(name: str) -> Optional[int]:
    # "decoder.layers.3.mlp.router" -> 3: the index in this stage's TransformerBlock,
    # which is what recompute_method="block" counts.
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


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
