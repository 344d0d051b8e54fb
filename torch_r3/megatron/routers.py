"""This model's MoE routers: where each sits in the model, and how it picks its experts under replay.

Routers are told apart by their place in the module tree: the router of
`decoder.layers[i]` is global layer `offset + i` of the captured routes (the
offset of this pipeline stage, from Megatron's own helpers); routers of
multi-token prediction layers (`mtp.layers[j]`) see shifted tokens that the
inference engine never routed, so they keep routing live. `layer_number` is not
used: newer megatron-core numbers MTP layers from 1 again.

Each replayed router gets two per-instance attributes while a hook is open,
never a change to Megatron's classes:

* `router_replay.get_replay_topk`, which takes the routes from this hook's own
  queue, checks their row count against the router's tokens, routes uncaptured
  tokens with the router's own top-k (`uncaptured="live"`), records the drift
  statistics, and hands recompute exactly what the forward chose;
* on expert-bias routers, and only where the installed release has the bug
  (`expert_bias_mask_is_broken`: 0.16 to 0.19.2 mask the `[N, E]` routing map
  with the `[N]` padding mask, a broadcast error on every training forward that
  passes `padding_mask`), `_apply_expert_bias`: the replacement counts the same
  tokens per expert with the mask widened to `[N, 1]`.

Each replayed router also gets a forward pre-hook and a forward hook, the
tripwire: a router call that did not consult replay while the hook had routes
installed for it (a routing type that bypasses `RouterReplay`, a
`router_replay` removed or replaced after the hook was built, a replaced
router forward) raises at once, naming the layer, instead of training on the
router's own choice.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from torch_r3.keys import ROUTER_MASK, ROUTES
from torch_r3.megatron.batch_checks import check_router_rows
from torch_r3.megatron.schedule import next_recompute
from torch_r3.replay import marker
from torch_r3.replay.modes import recorded_route_dtype
from torch_r3.replay.stats import StatsCollector

# Internals of the hook, shared with `hook.py` under plain names: nothing here is public.
__all__: list[str] = []

# The refusal of a recompute with nothing left to replay (`next_recompute` formats it).
_NO_RECOMPUTE = (
    "layer {layer}: activation recompute ran the router more often than the "
    "{pushes} microbatches installed; did forward_step_func run the model more "
    "than once per microbatch?"
)


@dataclass(eq=False)
class RouterTarget:
    """One microbatch's routes for one router.

    Attributes:
        indices: `[N, K]` on the model's device, in the router's token order,
            owned by the hook (never a view of the caller's batch: a buffer it
            reuses at its next step), in the routes' own dtype or int64; after
            the forward call, what the router actually used, int64 (recompute
            reuses it). `None` when recording: the forward fills in the
            router's own choice.
        uncaptured: `[N]` bool, `True` for tokens without a captured route.
        live: Whether uncaptured tokens take the router's own top-k.
        microbatch: Index of the microbatch in the step.
        batch_rows: Batch rows of this rank's routes (1 for the packed layout).
        recompute: Whether activation recompute will re-run the router for it.
        record: Route every token with the router's own top-k and keep the choice (R2).
        consulted: Forward router calls that took this target so far.
    """

    indices: torch.Tensor | None
    uncaptured: torch.Tensor
    live: bool
    microbatch: int
    batch_rows: int
    recompute: bool = False
    record: bool = False
    consulted: int = 0


@dataclass(eq=False)
class ReplayedRouter:
    """One replayed router of this model and what the hook tracks about it."""

    replay: RouterReplay
    module: Any  # Megatron's TopKRouter (untyped): its replaced methods and buffers are Megatron's
    layer: int  # global, 0-based
    recomputed: bool  # does activation recompute re-run this router in backward?
    stats: StatsCollector
    pushes: int = 0
    expected_pops: int = 0
    queue: list = field(default_factory=list)  # RouterTarget per entry of replay_backward_list
    current: RouterTarget | None = None
    recorded: dict = field(default_factory=dict)  # microbatch -> [N, K] own choice, when recording
    consults: int = 0  # router calls that consulted replay, all phases (the tripwire compares)
    _consults_before: int = 0
    _pending_drop: torch.Tensor | None = None
    _handles: list = field(default_factory=list)

    def attach(self, *, measure_drops: bool, fix_expert_bias: bool) -> None:
        """Install the per-instance replacements and the tripwire (see the module docstring)."""
        marker.claim(self.module, f"model: layer {self.layer}")
        self.replay.get_replay_topk = self._replay_topk
        if fix_expert_bias and getattr(self.module, "enable_expert_bias", False):
            self.module._apply_expert_bias = self._count_tokens_per_expert
        self._handles.append(self.module.register_forward_pre_hook(self._before_router))
        self._handles.append(self.module.register_forward_hook(self._after_router))
        if measure_drops:
            self._handles.append(self.module.register_forward_hook(self._count_drops))

    def check_free(self) -> None:
        """Raise `ValueError` when another open `ReplayHook` already holds this router."""
        marker.check_free(self.module, f"model: layer {self.layer}")

    def detach(self) -> None:
        """Remove the replacements; the instances route as Megatron's classes say again."""
        vars(self.replay).pop("get_replay_topk", None)
        vars(self.module).pop("_apply_expert_bias", None)
        marker.release(self.module)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def push(self, target: RouterTarget, *, expect_pop: bool) -> None:
        """Set one microbatch's routes for the forward and queue them for recompute."""
        self.replay.set_target_indices(target.indices)
        self.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self.queue.append(target)
        self.current = target
        self.pushes += 1
        self.expected_pops += expect_pop
        target.recompute = expect_pop

    def clear(self) -> None:
        self.replay.clear_indices()
        self.replay.clear_router_replay_action()
        self.queue.clear()
        self.current = None
        self._pending_drop = None
        self.pushes = 0
        self.expected_pops = 0
        self.consults = 0
        self._consults_before = 0
        self.recorded = {}

    def _replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        action = self.replay.router_replay_action
        current = self.current
        forward = action == RouterReplayAction.REPLAY_FORWARD and current is not None
        target: RouterTarget
        if current is not None and forward:
            target = current
            target.consulted += 1
            if target.consulted > 1 and target.recompute:
                raise RuntimeError(
                    f"microbatch {target.microbatch}, layer {self.layer}: the model ran {target.consulted} "
                    "times in one forward step with activation recompute; recompute re-runs the router "
                    "once per model call but the hook installs one set of routes per microbatch. Run "
                    "the model once per forward_step_func call (derive every loss from that output), or "
                    "run the extra pass outside the step or without recompute"
                )
        elif action == RouterReplayAction.REPLAY_BACKWARD and self.pushes:
            target = next_recompute(self.queue, _NO_RECOMPUTE, layer=self.layer, pushes=self.pushes)
            self.replay.replay_backward_list.pop(0)  # keep Megatron's FIFO in step with ours
        else:  # not ours to replay (no step running, or someone else's action): Megatron's logic
            return RouterReplay.get_replay_topk(self.replay, scores, topk, num_groups, group_topk, default_compute_topk)
        self.consults += 1
        check_router_rows(
            scores.shape[0],
            target.uncaptured.shape[0],
            target.batch_rows,
            microbatch=target.microbatch,
            layer=self.layer,
        )
        if forward:
            if default_compute_topk is None:
                raise RuntimeError(f"layer {self.layer}: the router passed no default_compute_topk to replay")
            with torch.no_grad():
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if target.record or target.indices is None:
                chosen = own
                self.recorded[target.microbatch] = own
            else:
                chosen = target.indices
                if target.live:  # widened to own's int64 in the same pass
                    chosen = torch.where(target.uncaptured.unsqueeze(-1), own, chosen)
                else:
                    chosen = chosen.to(own.dtype)  # no copy where the hook installed int64
                # On captured rows `chosen` is the replayed route in either mode.
                self.stats.add_drift(self.layer, own, chosen, ~target.uncaptured)
            target.indices = chosen  # recompute replays exactly what this forward chose
            self._pending_drop = chosen
        elif target.indices is None:  # a recorded microbatch is never recomputed (forward-only)
            raise RuntimeError(f"layer {self.layer}: recompute of a recorded microbatch {target.microbatch}")
        else:
            chosen = target.indices
        return scores.gather(1, chosen), chosen

    def _phase(self) -> str | None:
        """Which of this hook's phases a router call now is in, or `None` when replay is not ours."""
        action = self.replay.router_replay_action
        if action == RouterReplayAction.REPLAY_FORWARD and self.current is not None:
            return "in the forward"
        if action == RouterReplayAction.REPLAY_BACKWARD and self.pushes:
            return "in activation recompute"
        return None

    def _before_router(self, module, args) -> None:
        self._consults_before = self.consults

    def _after_router(self, module, args, output) -> None:
        phase = self._phase()
        if phase is None or self.consults != self._consults_before:
            return
        target = self.current if phase == "in the forward" else (self.queue[0] if self.queue else None)
        where = f"microbatch {target.microbatch}, " if target is not None else ""
        if getattr(module, "router_replay", None) is not self.replay:
            cause = (
                "its router_replay is no longer the RouterReplay the hook was built with (removed or "
                "replaced after the hook was built); build the hook after the model is final"
            )
        else:
            config = getattr(module, "config", None)
            cause = (
                "likely setting: a routing path that bypasses RouterReplay (config."
                f"moe_router_load_balancing_type={getattr(config, 'moe_router_load_balancing_type', None)!r}, "
                f"moe_router_fusion={getattr(config, 'moe_router_fusion', None)!r}) or a replaced router forward"
            )
        raise RuntimeError(
            f"{where}layer {self.layer}: the router ran {phase} without consulting replay, so it "
            f"routed with its own top-k instead of the installed routes; {cause}"
        )

    def _count_drops(self, module, args, output) -> None:
        if self._pending_drop is not None:
            self.stats.add_drops(self._pending_drop, output[1])
            self._pending_drop = None

    def _count_tokens_per_expert(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        # Megatron's own rule: count only in training forwards and recomputes with
        # gradients, never in evaluation; padding tokens (mask True) do not count.
        if torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.module.local_tokens_per_expert += routing_map.sum(dim=0)


class RouteBuffers:
    """The hook's own copy of each microbatch's routes, one buffer per microbatch of a step, reused step after step.

    A step's routes stay queued for activation recompute until the step ends,
    so each microbatch of the step has its buffer; the next step writes into
    the same memory (a buffer grows when a microbatch needs more), so a steady
    run allocates nothing per microbatch.
    """

    def __init__(self) -> None:
        self._bytes: list[torch.Tensor] = []

    def take(self, microbatch: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised `shape` tensor of `dtype` on `device`, microbatch `microbatch`'s buffer of this step."""
        need = math.prod(shape) * dtype.itemsize
        while len(self._bytes) <= microbatch:
            self._bytes.append(torch.empty(0, dtype=torch.uint8))
        buffer = self._bytes[microbatch]
        if buffer.numel() < need or buffer.device != device:
            buffer = torch.empty(need + need // 4, dtype=torch.uint8, device=device)  # room for a longer one
            self._bytes[microbatch] = buffer
        return buffer[:need].view(dtype).view(shape)

    def release(self) -> None:
        """Free every buffer (the hook is closed)."""
        self._bytes = []


def copy_for_routers(out: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """This rank's routes `[B, S, J, K]` into `out` `[J, S, B, K]`, once: row `j` is router `j`'s `[S * B, K]`.

    Each router reads its tokens sequence-first (`router_indices`' order). Where
    one route is 8 bytes (`K = 8` uint8, `K = 4` int16) and the dtype stays,
    the copy moves whole routes as 8-byte words; otherwise element by element
    (widening to `out`'s dtype).

    Returns:
        `out` viewed as `[J, S * B, K]`.
    """
    b, s, j, k = routes.shape
    source = routes.permute(2, 1, 0, 3)
    words = None
    if routes.dtype == out.dtype and k * routes.element_size() == 8:
        try:
            words = source.view(torch.int64)
        except RuntimeError:  # a route not contiguous in memory: element by element
            words = None
    if words is not None:
        out.view(torch.int64).copy_(words)
    else:
        out.copy_(source)
    return out.view(j, s * b, k)


def collect_recorded(
    routers: list[ReplayedRouter], shapes: list[tuple[int, int, bool, torch.Tensor]], num_experts: int
) -> list[dict[str, torch.Tensor]]:
    """A recording step's routes in the batch layout, one dict per microbatch (`shapes`: `(B, T, packed, padding)`).

    Each router kept its own choice per microbatch as `[S*B, K]`, sequence-first.
    """
    dtype = recorded_route_dtype(num_experts)
    out = []
    for i, (b, t, packed, pad) in enumerate(shapes):
        per_layer = [r.recorded[i].reshape(t, b, -1).transpose(0, 1) for r in routers]
        routes = torch.stack(per_layer, 2).to(dtype)  # [B, T, L, K]
        out.append({ROUTES: routes[0] if packed else routes, ROUTER_MASK: pad.clone()})
    return out


def check_fifos_drained(routers: list[ReplayedRouter]) -> None:
    """After a step: each router's backward FIFO holds exactly what recompute did not pop, or `RuntimeError`."""
    wrong = []
    for r in routers:
        left = len(r.replay.replay_backward_list)
        expected = r.pushes - r.expected_pops
        if left != expected:
            wrong.append(
                f"layer {r.layer}: {left} routes left in the backward FIFO after {r.pushes} forwards, expected {expected}"
            )
    if wrong:
        raise RuntimeError(
            "router replay FIFOs out of step after forward_backward (recompute replayed "
            "the wrong microbatch's routes or skipped some): " + "; ".join(wrong)
        )


@functools.cache
def expert_bias_mask_is_broken(apply_expert_bias: Callable | None = None) -> bool:
    """Whether `TopKRouter._apply_expert_bias` fails to mask an `[N, E]` map with an `[N]` padding mask.

    Tried on a two-token, three-expert probe through the plain Python function
    (the compiled wrapper keeps it in `__wrapped__`), so the answer comes from the
    installed code's behaviour, not from its version number.

    Args:
        apply_expert_bias: The function to probe; by default the installed
            `TopKRouter._apply_expert_bias`.

    Returns:
        `True` when the probe raises or counts a padded token.
    """
    if apply_expert_bias is None:
        from megatron.core.transformer.moe.router import TopKRouter

        apply_expert_bias = TopKRouter._apply_expert_bias
    fn = inspect.unwrap(apply_expert_bias)
    probe = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(3))
    try:
        with torch.enable_grad():
            fn(probe, torch.ones(2, 3, dtype=torch.bool), torch.tensor([True, False]))
    except Exception:  # the broadcast error (or anything else): keep the replacement
        return True
    return probe.local_tokens_per_expert.tolist() != [1.0, 1.0, 1.0]


def find_routers(
    chunk: torch.nn.Module, config: Any, first_layer: int, stats: StatsCollector
) -> tuple[list[ReplayedRouter], list[Any]]:
    """This chunk's routers with a `RouterReplay`: decoder routers to replay, MTP routers to leave live.

    Args:
        chunk: One model chunk (possibly wrapped in DDP or `Float16Module`).
        config: The model's `TransformerConfig`.
        first_layer: Global index (0-based) of this stage's first decoder layer.
        stats: Where the replayed routers record their statistics.

    Returns:
        `(replayed, live)`: the decoder routers in model order, and the routers
        of multi-token prediction layers.

    Raises:
        ValueError: When a router sits neither in `decoder.layers` nor in MTP layers.
    """
    granularity = getattr(config, "recompute_granularity", None)
    modules = getattr(config, "recompute_modules", None) or ()
    method = getattr(config, "recompute_method", None)
    selective_moe = (
        granularity == "selective" and "moe" in modules and getattr(config, "cuda_graph_impl", "none") != "local"
    )
    replayed, live = [], []
    for name, module in chunk.named_modules():
        replay = getattr(module, "router_replay", None)
        if not isinstance(replay, RouterReplay):
            continue
        parts = name.split(".")
        if "mtp" in parts:
            live.append(module)
            continue
        local = _decoder_layer_index(parts)
        if local is None:
            raise ValueError(
                f"model: the router {name!r} is neither in decoder.layers nor in the multi-token "
                "prediction layers; cannot tell which captured layer it routes"
            )
        recomputed = selective_moe
        if granularity == "full":
            recomputed = local < (config.recompute_num_layers or 0) if method == "block" else True
        replayed.append(
            ReplayedRouter(replay=replay, module=module, layer=first_layer + local, recomputed=recomputed, stats=stats)
        )
    return replayed, live


def _decoder_layer_index(parts: list[str]) -> int | None:
    # "decoder.layers.3.mlp.router" -> 3: the index in this stage's TransformerBlock
    # (also what recompute_method="block" counts).
    for a, b, c in zip(parts, parts[1:], parts[2:]):
        if a == "decoder" and b == "layers" and c.isdigit():
            return int(c)
    return None
