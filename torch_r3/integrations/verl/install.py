"""`install()`: verl's agent-loop route padding and its Megatron engine replay, swapped for `torch_r3`'s in one call.

What is replaced (verl 0.9.1), and where each call lands:

* agent loop, per sample: `AgentLoopWorker._agent_loop_postprocess`
  (`experimental/agent_loop/agent_loop.py`) runs after `keep_compact`, so it
  builds no zero-filled `[1, P + R, L, K]` `int16` tensor; the compact rows
  ride in the `DataProto`'s `non_tensor_batch[ROUTES_FIELD]`;
* driver: `left_right_2_no_padding` (`workers/utils/padding.py`, bound by name
  in `trainer/ppo/ray_trainer.py` and wherever else it is imported) writes the
  nested `routed_experts` from that column (`driver_routed_experts`),
  bit-identical to what it cut out of the padded tensor;
* engine: `apply_router_replay_patch` (`utils/megatron/router_replay_patch.py`,
  called by `MegatronEngine.__init__`) leaves Megatron's `TopKRouter` alone;
  in `workers/engine/megatron/transformer_impl.py`, `get_forward_backward_func`
  returns `EngineReplay.schedule`'s wrapper, `RouterReplayHelper` answers "not
  replaying" so `forward_step` skips `align_r3_router_replay_data`,
  `build_r3_replay_mask` and `set_router_replay_data`, and
  `MegatronEngine.forward_backward_batch` tells the schedule whether the step
  replays (verl's own switches: `router_replay.mode="R3"` and the batch's
  `enable_routing_replay`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from typing import Any

from torch_r3.integrations.swap import Swaps
from torch_r3.integrations.verl.agent_loop import ROUTES_FIELD, driver_routed_experts, keep_compact
from torch_r3.integrations.verl.schedule import EngineReplay
from torch_r3.replay.modes import check_uncaptured
from torch_r3.replay.stats import ReplayStats

__all__ = ["Installed", "install"]

AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"
PADDING = "verl.workers.utils.padding"
ENGINE = "verl.workers.engine.megatron.transformer_impl"
ROUTER_PATCH = "verl.utils.megatron.router_replay_patch"
_MARKER = "_torch_r3_installed"


class _HookReplays:
    """Stands in for verl's `RouterReplayHelper` in the engine module: replay is the hook's, never verl's."""

    @staticmethod
    def is_replay_forward_action(*args: Any, **kwargs: Any) -> bool:
        return False

    @staticmethod
    def is_replay_backward_action(*args: Any, **kwargs: Any) -> bool:
        return False

    @staticmethod
    def is_r2_record_action(*args: Any, **kwargs: Any) -> bool:
        return False


def _keep_megatron_router(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_router_replay_patch() -> None:
        """In place of verl's `apply_router_replay_patch`: Megatron's own `TopKRouter` and `RouterReplay` stay."""

    return apply_router_replay_patch


class Installed(contextlib.AbstractContextManager["Installed"]):
    """What `install()` swapped; `uninstall()` (or leaving the `with` block) puts verl's own back."""

    def __init__(self, swaps: Swaps, engine: EngineReplay | None) -> None:
        self._swaps: Swaps | None = swaps
        self.engine = engine
        self.names = tuple(name for name in swaps.swapped if not name.endswith(_MARKER))

    def __repr__(self) -> str:
        state = "installed" if self._swaps is not None else "uninstalled"
        return f"Installed(verl: {', '.join(self.names)}; {state})"

    @property
    def last_stats(self) -> ReplayStats | None:
        """The `ReplayStats` of the engine's last replaying step (drift, live tokens); `None` before it."""
        return None if self.engine is None else self.engine.last_stats

    def uninstall(self) -> None:
        """Restore verl's functions everywhere they are bound and remove the hooks; a second call does nothing."""
        if self._swaps is None:
            return
        swaps, self._swaps = self._swaps, None
        swaps.undo()
        if self.engine is not None:
            self.engine.close()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _compacting(original: Callable, num_experts: int | None) -> Callable:
    @functools.wraps(original)
    async def _agent_loop_postprocess(worker: Any, output: Any, validate: Any, **kwargs: Any) -> Any:
        keep_compact(output, num_experts=num_experts)
        return await original(worker, output, validate, **kwargs)

    return _agent_loop_postprocess


def _nested_from_compact(original: Callable) -> Callable:
    @functools.wraps(original)
    def left_right_2_no_padding(data: Any) -> Any:
        if ROUTES_FIELD not in data.keys():
            return original(data)
        if "routed_experts" in data.keys():
            raise ValueError(
                f"the batch holds both routed_experts and {ROUTES_FIELD}: the agent loop ran partly without "
                "torch_r3.integrations.verl.install()"
            )
        routes = list(data[ROUTES_FIELD])
        del data[ROUTES_FIELD]
        nested = driver_routed_experts(routes, data["attention_mask"])
        out = original(data)
        out["routed_experts"] = nested
        return out

    return left_right_2_no_padding


def install(
    *,
    agent_loop: bool = True,
    engine: bool = True,
    num_experts: int | None = None,
    uncaptured: str = "live",
    expert_load: bool = False,
) -> Installed:
    """Swap `torch_r3` into verl: the agent loop's route padding and the Megatron engine's replay, one call.

    Call it in every process that runs the side it swaps, before that side
    starts: the agent-loop workers and the driver (`agent_loop=True`), and each
    Megatron worker before its engine is built (`engine=True`: verl's router
    patch must not have run). Keep verl's own switches on
    (`actor_rollout_ref.rollout.enable_rollout_routing_replay=True`,
    `actor_rollout_ref.actor.router_replay.mode=R3`).

    Args:
        agent_loop: swap the agent loop's per-sample padding and the driver's
            `left_right_2_no_padding` of the routes.
        engine: swap the Megatron engine's replay for `ReplayHook`'s.
        num_experts: the model's expert count, to check each sample's ids
            against in the agent loop.
        uncaptured: what tokens without a captured route do (`ReplayHook`):
            `"live"` (the router's own top-k; verl replays its zero rows as
            expert 0, `K` times) or `"replay"`.
        expert_load: count tokens per expert in `last_stats` (`ReplayHook`).

    Returns:
        An `Installed` handle (also a context manager); `last_stats` is the
        engine's last replaying step's `ReplayStats`.

    Raises:
        RuntimeError: torch_r3 is already installed in this process, or
            verl's router patch already ran (`engine=True` after the engine was
            built).
        ModuleNotFoundError: verl (or, for `engine=True`, megatron-core) is not installed.
    """
    check_uncaptured(uncaptured)
    if not isinstance(expert_load, bool):
        raise TypeError(f"expert_load must be True or False, got {type(expert_load).__name__}")
    swaps = Swaps()
    replay: EngineReplay | None = None
    try:
        if agent_loop:
            loop = importlib.import_module(AGENT_LOOP)
            padding = importlib.import_module(PADDING)
            _claim(padding, swaps)
            worker = loop.AgentLoopWorker
            swaps.owned(worker, "_agent_loop_postprocess", _compacting(worker._agent_loop_postprocess, num_experts))
            swaps.everywhere(padding, "left_right_2_no_padding", _nested_from_compact(padding.left_right_2_no_padding))
        if engine:
            patch = importlib.import_module(ROUTER_PATCH)
            impl = importlib.import_module(ENGINE)
            _claim(impl, swaps)
            if getattr(patch.TopKRouter, "_router_replay_patched", False):
                raise RuntimeError(
                    "verl's router patch (apply_router_replay_patch) already replaced Megatron's TopKRouter in this "
                    "process: call torch_r3.integrations.verl.install() before the Megatron engine is built"
                )
            replay = EngineReplay(uncaptured=uncaptured, expert_load=expert_load)
            swaps.everywhere(patch, "apply_router_replay_patch", _keep_megatron_router(patch.apply_router_replay_patch))
            swaps.owned(impl, "RouterReplayHelper", _HookReplays)
            swaps.owned(
                impl, "get_forward_backward_func", replay.get_forward_backward_func(impl.get_forward_backward_func)
            )
            engine_class = impl.MegatronEngine
            swaps.owned(
                engine_class,
                "forward_backward_batch",
                replay.forward_backward_batch(engine_class.forward_backward_batch),
            )
    except BaseException:  # KeyboardInterrupt too: every module as it was
        swaps.undo()
        raise
    return Installed(swaps, replay)


def _claim(module: Any, swaps: Swaps) -> None:
    """Mark `module` as installed (a second `install()` is refused), as one more swap that `undo()` removes."""
    if getattr(module, _MARKER, False):
        raise RuntimeError(f"torch_r3 is already installed in {module.__name__}; uninstall() the first handle")
    swaps.owned(module, _MARKER, True)
