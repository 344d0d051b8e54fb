"""`ReplayHook`: replay a batch's routes in the MoE routers of one `transformers` model instance.

The hook finds the routers by walking the instance's module tree and registers
a forward hook on each router instance (never on a class, so every other model
in the process is unaffected). Outside `replay()` and `record()` the hooks
return the router's output unchanged. Inside `replay(batch)` each router call
keeps its live logits, takes the batch's experts for captured tokens (its own
for uncaptured ones, by default) and recomputes the weights of that choice with
its family's rule (`torch_r3.transformers.families`), so gradients reach the
router.

Activation checkpointing: `transformers` runs each decoder layer's forward
through the layer instance's `_gradient_checkpointing_func`. The hook wraps that
function on the layers that hold routers (before every forward of the model,
so checkpointing enabled before or after the hook is covered), so each
checkpointed call carries its own record of the experts its routers used, in
a replayed forward or not; the recompute in backward (which usually runs after
the `with` block, and may run inside another one) replays that record, live
rows included, whatever order backward visits the microbatches in. A forward
that ran outside `replay()` is recomputed as it ran: with the routers' own choice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from torch_r3.keys import CU_SEQLENS_PADDED, ROUTER_MASK, ROUTES
from torch_r3.replay.checks import check_input_shape, check_replayed_ids, check_route_batch, check_router_tokens
from torch_r3.replay.layers import moe_pattern, route_layer_map
from torch_r3.replay.lifecycle import HookLifecycle
from torch_r3.replay.modes import check_uncaptured, recorded_route_dtype
from torch_r3.replay.padding import padding_positions
from torch_r3.replay.recording import Recording
from torch_r3.replay.stats import ReplayStats, StatsCollector
from torch_r3.transformers._modules import LayerCalls, device_of, find_in_layers, note_inputs
from torch_r3.transformers.families import Family, family_of, supported_families

__all__ = ["Recording", "ReplayHook"]

# The child name torch.distributed's checkpoint_wrapper gives the module it wraps.
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


@dataclass
class _Router:
    module: torch.nn.Module
    name: str
    layer: int  # decoder layer, 0-based
    layer_module: torch.nn.Module
    family: Family


@dataclass
class _Call:
    """One checkpointed layer call: the experts its routers used, for its recompute."""

    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # router index -> [N, K]
    live: set[int] = field(default_factory=set)  # routers that routed with their own choice


@dataclass
class _Replay:
    rows: int
    positions: int
    routes: list[torch.Tensor]  # per router: [B * T, K] int64 on the router's device, batch-major
    uncaptured: torch.Tensor  # [B * T] bool, True = no captured route
    padding: torch.Tensor  # [B * T] bool, True = no real token (counted apart in the stats)


@dataclass
class _Recorder:
    """What one `record()` block has seen so far; its `Recording` is filled when the block ends."""

    recording: Recording
    shape: tuple[int, int] | None = None  # [B, T] of the forward's input_ids
    mask: torch.Tensor | None = None  # attention_mask == 0
    routes: dict[int, torch.Tensor] = field(default_factory=dict)  # router index -> own [B * T, K]
    forwards: int = 0


class ReplayHook(HookLifecycle):
    """Replays captured routes in the MoE routers of one Hugging Face `transformers` model.

    ```python
    hook = ReplayHook(model)
    for batch in loader:  # R3Collator batches
        with hook.replay(batch):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_from(logits).backward()
        print(hook.last_stats.mean_drift)
    ```

    Construct it once per model instance (before or after wrapping in DDP or
    sharding with FSDP2; pass the module whose tree holds the decoder layers).
    The batch's routes are checked when `replay()` is entered, before the model
    runs: expert ids in range and distinct per token; each router then checks
    that it sees one token per route.

    Args:
        model: A `transformers` MoE model (or a module wrapping one).
        uncaptured: What tokens without a captured route (`router_padding_mask`
            True: left padding, the last sampled token) do: `"live"` (default)
            routes them with the router's own choice, `"replay"` replays the
            filler routes the batch holds for them (then those are checked too).
        expert_load: Also count tokens per expert in each layer, from the
            replayed routes and from the router's own choice, into
            `last_stats.rollout_load` / `trainer_load` (off by default: a
            scatter-add per router call, on the routes' device).

    Raises:
        TypeError: When `model` is not a `torch.nn.Module`.
        ValueError: When the model holds a router of an unsupported class (the
            message names it and the supported families), holds no MoE router,
            or a router is not inside a decoder layer; when another
            `ReplayHook` on the model is still open; or `uncaptured` is neither
            `"live"` nor `"replay"`.
    """

    def __init__(self, model: torch.nn.Module, *, uncaptured: str = "live", expert_load: bool = False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.uncaptured = check_uncaptured(uncaptured)
        self._model = model
        self._routers, self._num_layers = _find_routers(model)
        self._topk, self._num_experts = _router_sizes(self._routers[0])
        for r in self._routers:
            if _router_sizes(r) != (self._topk, self._num_experts):
                topk, experts = _router_sizes(r)
                raise ValueError(
                    f"{r.name}: top_k={topk}, num_experts={experts} differ from the "
                    f"first router's top_k={self._topk}, num_experts={self._num_experts}"
                )
        if not isinstance(expert_load, bool):
            raise TypeError(f"expert_load: expected True or False, got {expert_load!r}")
        self._hold((r.module, r.name) for r in self._routers)  # a refused hook claims nothing
        self._stats = StatsCollector(measure_drops=False, num_experts=self._num_experts if expert_load else None)
        self._active: _Replay | None = None
        self._recording: _Recorder | None = None
        self._calls = LayerCalls(_Call)  # the checkpointed layer call running now
        self._last_stats: ReplayStats | None = None
        self._in_step = False
        self._handles = [
            r.module.register_forward_hook(functools.partial(self._on_router, i)) for i, r in enumerate(self._routers)
        ]
        self._handles.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._wrapped: list[tuple[torch.nn.Module, Callable]] = []  # (layer, its own checkpointing function)

    # ----------------------------------------------------------------- public

    @property
    def router_layers(self) -> tuple[int, ...]:
        """Decoder layer (0-based) of each replayed router, in model order."""
        return tuple(r.layer for r in self._routers)

    @property
    def layers(self) -> tuple[int, ...]:
        """Alias of `router_layers`."""
        return self.router_layers

    @property
    def num_layers(self) -> int:
        """The model's decoder layers, MoE and dense: the `L` of routes that cover every layer."""
        return self._num_layers

    @property
    def topk(self) -> int:
        """Experts per token (`K`)."""
        return self._topk

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer; replayed ids must lie in `[0, num_experts)`."""
        return self._num_experts

    @property
    def last_stats(self) -> ReplayStats | None:
        """`ReplayStats` of the last `replay()` block (or `step()`) that exited cleanly; `None` before the first.

        Counts the forwards (recompute is not counted again): route drift per MoE
        layer, the live share, captured/live/filler token counts.
        """
        return self._last_stats

    @contextlib.contextmanager
    def replay(self, batch: Mapping[str, Any]) -> Iterator[ReplayHook]:
        """Replay `batch`'s routes in every forward of the model inside the block.

        Args:
            batch: A collated batch: `rollout_expert_indices` `[B, T, L, K]` and
                `router_padding_mask` `[B, T]` (or the packed `[N, L, K]`, `[N]`
                and `cu_seqlens`, for a `[1, N]` `position_ids`-packed forward);
                `L` is every decoder layer or only the MoE layers.

        Raises:
            ValueError: Before the model runs, for a bad layout or a bad route
                (naming the layer and position); inside the block, when a router
                sees a different number of tokens than the batch covers.
            RuntimeError: When `replay()` or `record()` is already active.
        """
        self._check_idle()
        routes, mask, cu_seqlens = check_route_batch(batch, self._topk)
        if cu_seqlens is not None:  # the packed layout is one row of a [1, N] forward
            routes, mask = routes.unsqueeze(0), mask.unsqueeze(0)
        pattern = moe_pattern(self.router_layers, self._num_layers)
        columns = route_layer_map(self.router_layers, routes.shape[2], pattern)
        if columns != list(range(routes.shape[2])):
            routes = routes[:, :, columns]
        checked = ~mask if self.uncaptured == "live" else torch.ones_like(mask)
        # Positions in messages count from each sequence's first row (cu_seqlens_padded when aligned).
        offsets = batch.get(CU_SEQLENS_PADDED, cu_seqlens) if cu_seqlens is not None else None
        check_replayed_ids(routes, checked, self.router_layers, self._num_experts, cu_seqlens=offsets, uncaptured=mask)
        rows, positions = mask.shape
        device = device_of(self._routers[0].module)
        # One copy to the device, widened once: the experts index with int64.
        wide = routes.to(device=device, dtype=torch.int64)
        per_router = [wide[:, :, j].reshape(rows * positions, self._topk) for j in range(len(self._routers))]
        padding = padding_positions(batch, mask, cu_seqlens)
        self._active = _Replay(rows, positions, per_router, mask.to(device).reshape(-1), padding.to(device).reshape(-1))
        try:
            with self._counting():
                yield self
        finally:
            self._active = None

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Count the block's forwards into `last_stats` if it exits cleanly; inside a step, the step counts."""
        if self._in_step:
            yield
            return
        self._stats.reset()
        yield
        self._last_stats = self._stats.finish(self.router_layers)

    @contextlib.contextmanager
    def step(self) -> Iterator[ReplayHook]:
        """Bracket one optimizer step's microbatches, so that `last_stats` covers all of them.

        ```python
        with hook.step():
            for mb in microbatches:
                with hook.replay(mb):
                    loss = loss_fn(model(...))
                loss.backward()
        hook.last_stats.microbatches  # len(microbatches)
        ```

        Raises:
            RuntimeError: When a step is already active.
        """
        if self._in_step:
            raise RuntimeError("ReplayHook.step() is already active; steps do not nest")
        with self._counting():
            self._in_step = True
            try:
                yield self
            finally:
                self._in_step = False

    @contextlib.contextmanager
    def record(self) -> Iterator[Recording]:
        """Record the routers' own choice in one forward (R2): yields a `Recording`.

        ```python
        with torch.no_grad(), hook.record() as rec:
            model(input_ids=ids, attention_mask=mask)
        with hook.replay({**rec.batch, "input_ids": ids}):
            ...
        ```

        Raises:
            RuntimeError: When `replay()` or `record()` is already active, or the
                block ran no forward or more than one.
        """
        self._check_idle()
        rec = _Recorder(Recording())
        self._recording = rec
        handle = self._model.register_forward_pre_hook(functools.partial(note_inputs, rec), with_kwargs=True)
        try:
            yield rec.recording
        finally:
            handle.remove()
            self._recording = None
        rec.recording.microbatches.append(self._recorded_batch(rec))

    # --------------------------------------------------------------- internals

    def _restore(self) -> None:
        # Closing also hands each checkpointed layer its own checkpointing function back.
        self._calls.restore(self._wrapped)
        self._wrapped = []

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._wrap_checkpointing()
        state = self._active
        if state is None:
            return
        name, ids = "input_ids", args[0] if args else kwargs.get("input_ids")
        if ids is None and kwargs.get("inputs_embeds") is not None:
            name, ids = "inputs_embeds[..., 0]", kwargs["inputs_embeds"][..., 0]
        if isinstance(ids, torch.Tensor):  # a token count alone cannot tell [3, 4] from [2, 6]
            check_input_shape((state.rows, state.positions), tuple(ids.shape), where="replay()", name=name)

    def _on_router(self, index: int, module: torch.nn.Module, args: Any, output: Any) -> Any:
        r = self._routers[index]
        call: _Call | None = self._calls.current
        if call is not None and index in call.experts:  # activation recompute: exactly the first forward's experts
            experts = call.experts[index]
            if index in call.live and torch.equal(output[2], experts):
                return None  # routed live the first time, and the same again: the router's own output
            return output[0], r.family.weights(module, output[0], experts), experts
        if self._recording is not None:
            self._recording.routes[index] = output[2].detach()
            if index == 0:
                self._recording.forwards += 1
        state = self._active
        if state is None:  # routed live (or recorded): a recompute must route the same way
            if call is not None:
                call.experts[index] = output[2].detach()
                call.live.add(index)
            return None
        logits, _, own = output
        check_router_tokens(
            logits.shape[0],
            state.rows * state.positions,
            state.rows,
            where=f"layer {r.layer}",
            hint="; pass the input_ids the routes were collated with",
        )
        replayed = state.routes[index]
        if self.uncaptured == "live":
            experts = torch.where(state.uncaptured.unsqueeze(-1), own, replayed)
        else:
            experts = replayed
        if index == 0:
            self._stats.add_microbatch(state.uncaptured, live=self.uncaptured == "live", padding=state.padding)
        self._stats.add_drift(r.layer, own, replayed, ~state.uncaptured)
        if call is not None:
            call.experts[index] = experts
        return logits, r.family.weights(module, logits, experts), experts

    def _wrap_checkpointing(self) -> None:
        """Wrap each router layer's checkpointing function (set by transformers, maybe since the last forward)."""
        self._wrapped.extend(self._calls.wrap(r.layer_module for r in self._routers))

    def _recorded_batch(self, rec: _Recorder) -> dict[str, torch.Tensor]:
        if rec.forwards != 1 or rec.shape is None:
            raise RuntimeError(
                f"record(): expected exactly one forward of the model in the block, got {rec.forwards}"
                + ("" if rec.shape is not None else " (with input_ids or inputs_embeds)")
            )
        rows, positions = rec.shape
        dtype = recorded_route_dtype(self._num_experts)
        first = next(iter(rec.routes.values()))
        out = torch.zeros((rows, positions, self._num_layers, self._topk), dtype=dtype, device=first.device)
        for index, own in rec.routes.items():
            out[:, :, self._routers[index].layer] = own.reshape(rows, positions, self._topk).to(dtype)
        mask = rec.mask if rec.mask is not None else torch.zeros((rows, positions), dtype=torch.bool)
        return {ROUTES: out.cpu(), ROUTER_MASK: mask.cpu()}


def _find_routers(model: torch.nn.Module) -> tuple[list[_Router], int]:
    found, num_layers = find_in_layers(model, _is_router, "a router")
    if not found:
        raise ValueError(
            f"model ({type(model).__name__}): no MoE router found; supported families: {supported_families()}"
        )
    routers = []
    for f in found:
        if _CHECKPOINT_WRAPPED in f.name.split("."):
            raise ValueError(
                f"{f.name}: the router sits inside torch's checkpoint_wrapper, whose recompute the hook cannot "
                "follow (it would route with the router's own choice); unwrap it and use the model's "
                "activation_checkpointing_enable() instead, which ReplayHook replays exactly"
            )
        family = cast(Family, family_of(f.module))  # picked for having one
        routers.append(_Router(f.module, f.name, f.layer, f.layer_module, family))
    return routers, num_layers


def _is_router(name: str, module: torch.nn.Module) -> bool:
    if family_of(module) is not None:
        return True
    _refuse_unknown_router(name, module)
    return False


def _refuse_unknown_router(name: str, module: torch.nn.Module) -> None:
    # A router we do not know would route with its own choice under replay: refuse it instead.
    children = module._modules
    suspects = [(name, type(module).__name__)] if "router" in type(module).__name__.lower() else []
    if "experts" in children:
        for attr in ("gate", "router"):
            child = children.get(attr)
            if child is not None and family_of(child) is None:
                suspects.append((f"{name}.{attr}" if name else attr, type(child).__name__))
    if suspects:
        where, cls = suspects[0]
        raise ValueError(
            f"{where}: router class {cls} is not supported by torch_r3.transformers.ReplayHook; "
            f"supported families: {supported_families()}"
        )


def _router_sizes(r: _Router) -> tuple[int, int]:
    module: Any = r.module  # plain attributes nn.Module's typing cannot see
    return int(module.top_k), int(module.num_experts)
