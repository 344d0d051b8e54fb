"""verl's Megatron engine step replayed through `torch_r3.megatron.ReplayHook`: what `install()` hands the engine.

verl 0.9.1's `MegatronEngine.forward_backward_batch`
(`workers/engine/megatron/transformer_impl.py`) splits the batch into
micro-batches (nested `input_ids`, `routed_experts`, ...) and calls Megatron's
schedule with its own `forward_step`, which, per micro-batch, aligns the routes
(`align_r3_router_replay_data`), builds verl's replay mask
(`build_r3_replay_mask`) and writes both into verl's patched routers
(`set_router_replay_data`). Under `install()` the engine's schedule is
`EngineReplay.schedule`: each micro-batch becomes the packed batch the hook
replays (`torch_r3.integrations.verl.microbatch`, aligned as
`preprocess_thd_engine` aligns the model's input), the hook installs it into
Megatron's own routers, and verl's `forward_step` then runs on verl's own
micro-batch, unchanged, with its replay block off.

Refused here, each with the reason (they stay verl's: `uninstall()`):
virtual-pipeline chunks (the hook refuses interleaved schedules), verl's R2
recording (`router_replay.mode="R2"`), dynamic context parallelism, the
`contiguous` context-parallel layout (DSv4 hybrid attention) and fp8's THD
padding (`use_fp8_padding`, a total alignment on the last sequence).
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torch_r3.collate.layout import Packed
from torch_r3.integrations.verl.engine import microbatch
from torch_r3.replay.stats import ReplayStats

if TYPE_CHECKING:
    from torch_r3.megatron import ReplayHook

__all__ = ["EngineReplay", "thd_alignment"]

ROUTED_EXPERTS = "routed_experts"


def thd_alignment(config: Any) -> int | None:
    """The per-sequence alignment of verl's packed (THD) model input: `preprocess_thd_engine`'s `align_size`.

    TP size, times `2 * CP` under context parallelism (zigzag). `None` when it is 1.

    Raises:
        NotImplementedError: fp8's THD padding, or the `contiguous` context-parallel
            layout (DSv4 hybrid attention), which the hook does not slice.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    if getattr(config, "fp8", None) in ("e4m3", "hybrid"):
        raise NotImplementedError(
            f"fp8={config.fp8!r}: verl pads the packed batch's last sequence to Transformer Engine's total "
            "alignment (use_fp8_padding); torch_r3 does not reproduce that layout: uninstall() to keep verl's replay"
        )
    if cp > 1 and getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid":
        raise NotImplementedError(
            "context parallelism with DSv4 hybrid attention: verl splits the packed buffer contiguously; "
            "ReplayHook slices per document or per sequence (zigzag) only: uninstall() to keep verl's replay"
        )
    align = tp * cp * (2 if cp > 1 else 1)
    return align if align > 1 else None


class _Step:
    def __init__(self, replay: bool) -> None:
        self.replay = replay


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("torch_r3_verl_step", default=None)


class _Microbatch(dict):
    """The packed routes the hook reads; `verl` is verl's own micro-batch, for its forward step."""

    verl: Any


def _non_tensor(batch: Any, key: str, default: Any = None) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(batch, key=key, default=default)


class EngineReplay:
    """One process's replay state under `install()`: a `ReplayHook` per model, built at its first replaying step.

    Args:
        uncaptured: `ReplayHook`'s `uncaptured` (`"live"`: tokens without a
            captured route, verl's zero rows among them, route with the
            router's own top-k).
        expert_load: `ReplayHook`'s `expert_load`.
    """

    def __init__(self, *, uncaptured: str = "live", expert_load: bool = False) -> None:
        self.uncaptured = uncaptured
        self.expert_load = expert_load
        self._hooks: weakref.WeakKeyDictionary[torch.nn.Module, ReplayHook] = weakref.WeakKeyDictionary()
        self.last_stats: ReplayStats | None = None

    def hook_for(self, model: Any) -> ReplayHook:
        """The hook of verl's `self.module` (a list of model chunks), built on first use."""
        from torch_r3.megatron import InterleavedPipelineError, ReplayHook

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise InterleavedPipelineError(
                f"verl's engine holds {len(chunks)} virtual-pipeline chunks: ReplayHook refuses interleaved "
                "schedules (a recompute would pop another chunk's routes); uninstall() to keep verl's VPP replay"
            )
        hook = self._hooks.get(chunks[0])
        if hook is None:
            hook = ReplayHook(chunks[0], uncaptured=self.uncaptured, expert_load=self.expert_load)
            self._hooks[chunks[0]] = hook
        return hook

    def close(self) -> None:
        """Remove every hook from its model (the routers get Megatron's own methods back)."""
        for hook in list(self._hooks.values()):
            hook.close()
        self._hooks.clear()

    def forward_backward_batch(self, original: Callable) -> Callable:
        """`MegatronEngine.forward_backward_batch`, telling the schedule whether this step replays."""

        @functools.wraps(original)
        def forward_backward_batch(engine: Any, data: Any, loss_function: Callable, forward_only: bool = False) -> Any:
            replay = bool(engine.enable_routing_replay) and bool(
                _non_tensor(data, "enable_routing_replay", default=False)
            )
            mode = engine.engine_config.router_replay.mode
            if replay and mode != "R3":
                raise NotImplementedError(
                    f"router_replay.mode={mode!r} under torch_r3.integrations.verl.install(): only R3 (routes from "
                    "the rollout) replays through ReplayHook; verl's R2 recording is not replaced (uninstall() first)"
                )
            token = _STEP.set(_Step(replay))
            try:
                return original(engine, data, loss_function, forward_only)
            finally:
                _STEP.reset(token)

        return forward_backward_batch

    def get_forward_backward_func(self, original: Callable) -> Callable:
        """Megatron's `get_forward_backward_func`, as the engine module calls it, returning `schedule`'s wrapper."""

        @functools.wraps(original)
        def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable:
            return functools.partial(self.schedule, original(*args, **kwargs))

        return get_forward_backward_func

    def schedule(self, megatron_schedule: Callable, **kwargs: Any) -> Any:
        """Run Megatron's schedule for one engine step, replaying each micro-batch's routes through the hook."""
        step = _STEP.get()
        if step is None or not step.replay:
            return megatron_schedule(**kwargs)
        iterator = kwargs["data_iterator"]
        if isinstance(iterator, list):  # make_batch_generator: one iterator per virtual-pipeline chunk
            if len(iterator) != 1:
                self.hook_for(kwargs["model"])  # refuses, naming the chunks
            iterator = iterator[0]
        hook = self.hook_for(kwargs["model"])
        align = thd_alignment(hook.config)
        packed = []
        for i, batch in enumerate(iterator):
            if _non_tensor(batch, "local_cp_size") is not None:
                raise NotImplementedError(
                    "dynamic context parallelism (local_cp_size): verl reshapes each micro-batch's CP group; "
                    "ReplayHook slices for the static CP group only: uninstall() to keep verl's replay"
                )
            if ROUTED_EXPERTS not in batch.keys():
                raise ValueError(
                    f"micro-batch {i}: no routed_experts in a replaying step (enable_routing_replay is set): "
                    "the rollout returned no routes for this batch"
                )
            mb = _Microbatch(
                microbatch(batch[ROUTED_EXPERTS], batch["input_ids"], layout=Packed(pad_to_multiple_of=align))
            )
            mb.verl = batch
            packed.append(mb)
        forward_step = kwargs.pop("forward_step_func")

        def verl_forward_step(data_iterator: Any, model: Any, *args: Any, **kw: Any) -> Any:
            return forward_step(iter((next(data_iterator).verl,)), model, *args, **kw)

        kwargs["data_iterator"] = iter(packed)
        out = hook.forward_backward(megatron_schedule, forward_step_func=verl_forward_step, **kwargs)
        self.last_stats = hook.last_stats
        return out
