"""SkyRL's Megatron worker replay, swapped for `torch_r3.megatron.ReplayHook`: what `install(worker=True)` does.

SkyRL 0.4.0's `MegatronModelWrapper`
(`skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py`) calls,
in both `forward` and `forward_backward_mini_batch`:

* `router_replay_schedule(enabled)` around Megatron's `forward_backward_func`
  (it clears Megatron's process-global `RouterReplay` state before and after);
* inside its forward-step closure, `setup_per_microbatch_replay_forward(...)`,
  which aligns the micro-batch's packed routes to the model's token layout,
  slices them for sequence parallelism, writes them into every
  `RouterReplay` instance batch-first, and returns `{"padding_mask": ...}` for
  the model call;
* after the model call (training only), `setup_per_microbatch_replay_backward()`.

`SkyRLWorkerReplay` provides the same four names (`patch_topk_router_layer_number`,
called by `MegatronPolicyWorker` before the model is built, becomes a no-op:
the hook maps layers from the model's own routers), and wraps the wrapper
module's `get_forward_backward_func` so that each schedule SkyRL runs with
replay is one `ReplayHook.step` of the model it runs (forward-only or not, as
SkyRL passes it). Per micro-batch the routes are brought into the layout
SkyRL's model call gets (SkyRL's own `TokenMetadataLayout` decides the
alignment, and is checked against): where that layout is SkyRL's packed one
as it stands (no sequence aligned further), they are taken as they are, checked
(`torch_r3.integrations.skyrl.worker.packed_view`), else collated by
`torch_r3.integrations.skyrl.worker.microbatch`; then they are installed with
`ReplayHook.begin_microbatch`; the returned
keyword arguments are empty, and the hook hands the model its `padding_mask`
(true padding only). SkyRL's forward-step closure, VLM inputs, FP8, MTP and the
fused LM head run unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from torch_r3.collate.layout import Packed, Padded
from torch_r3.integrations.skyrl.worker import microbatch, packed_view
from torch_r3.keys import ATTENTION_MASK, ROUTER_MASK, ROUTES

__all__ = ["MODEL_WRAPPER", "REPLAY_UTILS", "SkyRLWorkerReplay"]

REPLAY_UTILS = "skyrl.backends.skyrl_train.utils.replay_utils"
"""SkyRL's module of replay set-up functions that `install(worker=True)` replaces."""

MODEL_WRAPPER = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"
"""SkyRL's Megatron model wrapper: it imports those functions by name and runs Megatron's schedules."""

SCHEDULE_LOOKUP = "get_forward_backward_func"  # Megatron's, looked up in MODEL_WRAPPER at each call


class SkyRLWorkerReplay:
    """One worker process's replacement of SkyRL's replay set-up: a `ReplayHook` per model chunk.

    Args:
        uncaptured: the hooks' `uncaptured` (`"live"`: tokens without a captured
            route, the last sampled token, route with the router's own top-k;
            `"replay"`: SkyRL's filler rows `0..K-1` are replayed, as SkyRL does).
        expert_load: the hooks' `expert_load`.

    The hooks are built at the first schedule each model runs with replay,
    and closed by `close()` (which `Installed.uninstall()` calls).
    """

    def __init__(self, *, uncaptured: str = "live", expert_load: bool = False) -> None:
        from torch_r3.replay.modes import check_uncaptured

        check_uncaptured(uncaptured)
        self.uncaptured = uncaptured
        self.expert_load = expert_load
        self.hooks: dict[int, Any] = {}  # id(model chunk) -> ReplayHook (the hook holds the chunk)
        self._enabled = False  # inside router_replay_schedule(True)
        self._active: dict[int, Any] = {}  # the hooks whose step is running

    @property
    def last_stats(self) -> Any:
        """The `ReplayStats` of the last schedule run with replay (its first model chunk); `None` before."""
        stats = [h.last_stats for h in self.hooks.values() if h.last_stats is not None]
        return stats[-1] if stats else None

    # ------------------------------------------------------- SkyRL's four names

    @contextlib.contextmanager
    def router_replay_schedule(self, enabled: bool) -> Iterator[None]:
        """SkyRL's `router_replay_schedule`: marks the schedule it wraps as one replaying step."""
        if self._enabled:
            raise RuntimeError("router_replay_schedule: already inside one; SkyRL's schedules do not nest")
        self._enabled = bool(enabled)
        try:
            yield
        finally:
            self._enabled = False

    def setup_per_microbatch_replay_forward(
        self,
        rollout_expert_indices: Any,
        router_padding_mask: torch.Tensor | None,
        attention_mask: torch.Tensor,
        model: Any,
        model_config: Any,
        metadata_layout: Any,
        remove_microbatch_padding: bool = False,
    ) -> dict[str, torch.Tensor]:
        """SkyRL's per-micro-batch set-up: the micro-batch's routes installed by the model's `ReplayHook`.

        Returns:
            `{}`: the hook passes the model its `padding_mask` itself.

        Raises:
            RuntimeError: outside a replaying schedule of this model.
            ValueError: the routes or masks do not fit the micro-batch (naming the trajectory).
        """
        del model_config  # the hook holds the model's config
        hook = self._active.get(id(model))
        if hook is None:
            raise RuntimeError(
                "setup_per_microbatch_replay_forward: no replaying schedule is running for this model; "
                "torch_r3 installs routes inside SkyRL's router_replay_schedule(True) around the "
                "forward_backward_func that MegatronModelWrapper gets from get_forward_backward_func"
            )
        if router_padding_mask is None:
            raise ValueError("router_padding_mask: required with rollout_expert_indices (SkyRL's batch carries both)")
        mask = attention_mask.to(torch.bool)
        hook.begin_microbatch(
            self._collate(rollout_expert_indices, router_padding_mask, mask, metadata_layout, remove_microbatch_padding)
        )
        return {}

    def setup_per_microbatch_replay_backward(self) -> None:
        """SkyRL's switch to backward: the open micro-batch's routes are queued for recompute."""
        for hook in self._active.values():
            hook.end_microbatch()

    def patch_topk_router_layer_number(self) -> None:
        """SkyRL's `TopKRouter.set_layer_number` patch: not needed, the hook maps each router's own layer."""

    # ---------------------------------------------------------------- schedule

    def get_forward_backward_func(self, original: Any) -> Any:
        """Megatron's `get_forward_backward_func`, its schedule run as a `ReplayHook` step when SkyRL replays."""

        def lookup(*args: Any, **kwargs: Any) -> Any:
            schedule = original(*args, **kwargs)

            def replaying_schedule(**schedule_kwargs: Any) -> Any:
                if not self._enabled:
                    return schedule(**schedule_kwargs)
                if self._active:
                    raise RuntimeError("a replaying schedule is already running in this process")
                chunks = schedule_kwargs.get("model")
                chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
                hook = self._hook(chunks)
                key = id(chunks[0])
                with hook.step(
                    forward_only=bool(schedule_kwargs.get("forward_only", False)),
                    num_microbatches=schedule_kwargs.get("num_microbatches"),
                ):
                    self._active[key] = hook
                    try:
                        return schedule(**schedule_kwargs)
                    finally:
                        hook.end_microbatch()
                        self._active.clear()

            return replaying_schedule

        lookup.__wrapped__ = original  # type: ignore[attr-defined]  # functions take attributes
        return lookup

    def close(self) -> None:
        """Close every hook: the routers get Megatron's own methods back."""
        hooks, self.hooks = self.hooks, {}
        for hook in hooks.values():
            hook.close()

    # --------------------------------------------------------------- internals

    def _hook(self, chunks: list[Any]) -> Any:
        from torch_r3.megatron import ReplayHook

        key = id(chunks[0])
        hook = self.hooks.get(key)
        if hook is None:
            # A list of more than one chunk (virtual pipeline stages) is refused by the hook itself.
            hook = ReplayHook(chunks, uncaptured=self.uncaptured, expert_load=self.expert_load)
            self.hooks[key] = hook
        return hook

    @staticmethod
    def _collate(
        routes: Any, router_mask: torch.Tensor, attention: torch.Tensor, layout: Any, packed: bool
    ) -> dict[str, torch.Tensor]:
        if layout is None:
            raise ValueError("metadata_layout: SkyRL builds one for every replayed micro-batch; got None")
        lengths = attention.sum(1).tolist()
        fields = {
            "sequences": torch.zeros_like(attention, dtype=torch.long),
            ATTENTION_MASK: attention,
            ROUTES: routes,
            ROUTER_MASK: router_mask,
        }
        if packed:
            padded = list(getattr(layout, "padded_sequence_lengths", None) or [])
            if len(padded) != len(lengths):
                raise ValueError(
                    f"metadata_layout: remove_microbatch_padding=True but the layout holds padded lengths "
                    f"{padded} for {len(lengths)} sequences"
                )
            # SkyRL's packed routes already are the model's layout when no sequence is aligned further
            # (TP = CP = 1, no FP8): the hook takes them as they are, checked, without a second collation.
            batch = packed_view(fields) if padded == lengths else None
            if batch is None:
                multiple = math.gcd(*padded) or 1  # the alignment unit each sequence was rounded up to
                batch = microbatch(fields, layout=Packed(pad_to_multiple_of=multiple))
        else:
            multiple = int(layout.aligned_sequence_length)  # the longest, rounded up: one multiple of itself
            batch = microbatch(fields, layout=Padded(side="right", pad_to_multiple_of=multiple))
        _check_layout(batch, layout, packed)
        batch.pop("input_ids")  # the model's own ids come from SkyRL's remove_left_padding/preprocess_packed_seqs
        return batch


def _check_layout(batch: dict[str, torch.Tensor], layout: Any, packed: bool) -> None:
    """The collated micro-batch has the token layout SkyRL's model call gets, or the step is refused."""
    if packed:
        ours = batch["cu_seqlens_padded"].tolist() if "cu_seqlens_padded" in batch else batch["cu_seqlens"].tolist()
        theirs = [int(x) for x in layout.cu_seqlens_padded.tolist()]
    else:
        ours, theirs = [batch[ROUTES].shape[1]], [int(layout.aligned_sequence_length)]
    if ours != theirs:
        raise ValueError(
            f"metadata_layout: SkyRL aligns this micro-batch to {theirs}, torch_r3's collation gives {ours}"
        )
