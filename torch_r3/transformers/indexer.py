"""Replay a batch's indexer selections in the DSA indexers of one `transformers` model instance.

`IndexerReplayHook` finds the lightning indexers (`DeepseekV32Indexer`,
`GlmMoeDsaIndexer`) by walking the instance's module tree and registers a
forward hook on each (never on a class). Outside `replay()` and `record()` the
indexers run unchanged. Inside `replay(batch)` each indexer call returns the
batch's selection for captured queries and its own for uncaptured ones (by
default), in the model's `[B, S, topk]` `int32` form; the attention then masks
exactly what the engine's attention masked. GLM's shared layers (no indexer of
their own) reuse the previous full layer's top-k, replayed or not, so only the
full layers are hooked; the batch's columns for shared layers must equal their
source's (SGLang mirrors them), which is checked.

`DSAReplayHook` is the one hook for a DSA MoE model: it holds the MoE
`torch_r3.transformers.ReplayHook` and an `IndexerReplayHook`, and its
`replay(batch)` replays both kinds of choice from one collated batch.

Activation checkpointing: as the MoE hook does, while `replay()` is active the
hook wraps each decoder layer's `_gradient_checkpointing_func`, so each
checkpointed call keeps the selections its indexers returned, and the
recompute in backward returns exactly those.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_r3.collate.selections import SELECTION_MASK, SELECTIONS
from torch_r3.replay.lifecycle import HookLifecycle
from torch_r3.replay.modes import check_uncaptured
from torch_r3.replay.padding import padding_positions
from torch_r3.replay.recording import Recording
from torch_r3.replay.selection_checks import (
    canonical_rows,
    check_selection_batch,
    check_selection_values,
    first_positions,
)
from torch_r3.replay.selection_stats import IndexerStats, SelectionStatsCollector
from torch_r3.selections import FILL
from torch_r3.transformers._modules import LayerCalls, device_of, find_in_layers, note_inputs

__all__ = ["DSAReplayHook", "IndexerReplayHook", "IndexerStats"]

INDEXER_CLASSES = (
    ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Indexer"),
    ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaIndexer"),
)
"""The indexer classes the hook replays (module, class name), checked against `transformers` 5.24."""


@dataclass
class _Recorder:
    """What one `record()` block has seen so far."""

    shape: tuple[int, int] | None = None
    mask: torch.Tensor | None = None
    own: dict[int, torch.Tensor] = field(default_factory=dict)
    forwards: int = 0


@dataclass
class _Indexer:
    module: torch.nn.Module
    name: str
    layer: int
    layer_module: torch.nn.Module
    topk: int


@dataclass
class _Replay:
    shape: tuple[int, int]
    first: torch.Tensor  # [B]
    columns: list[torch.Tensor]  # per indexer: [B, T, K] in the batch's compact dtype, canonical
    uncaptured: torch.Tensor  # [B, T] bool
    padding: torch.Tensor  # [B, T] bool, True = no real token (counted apart in the stats)


def _is_indexer(module: torch.nn.Module) -> bool:
    return any((c.__module__, c.__name__) in INDEXER_CLASSES for c in type(module).__mro__)


class IndexerReplayHook(HookLifecycle):
    """Replays captured indexer selections in the DSA indexers of one `transformers` model.

    ```python
    hook = IndexerReplayHook(model)
    with hook.replay(batch):  # rollout_indexer_topk [B, T, L, K], indexer_padding_mask [B, T]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ```

    Args:
        model: A `transformers` DSA model (`deepseek_v32`, `glm_moe_dsa`) or a
            module wrapping one.
        uncaptured: Queries without a captured selection (left padding, the
            last token): `"live"` (default) uses the model's own indexer,
            `"replay"` lets each of them attend to itself only (the batch holds `-1`
            rows there, the filler).

    Raises:
        TypeError: `model` is not a `torch.nn.Module`.
        ValueError: no indexer in the model, an indexer outside a decoder
            layer, another hook on it, or a bad `uncaptured`.
    """

    def __init__(self, model: torch.nn.Module, *, uncaptured: str = "live"):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.uncaptured = check_uncaptured(uncaptured)
        self._model = model
        self._indexers, self._num_layers = _find_indexers(model)
        self._hold((ix.module, ix.name) for ix in self._indexers)  # a refused hook claims nothing
        self._active: _Replay | None = None
        self._recording: _Recorder | None = None
        self._calls = LayerCalls(dict)  # the checkpointed layer call running now: indexer -> its selection
        self._stats = SelectionStatsCollector()
        self._last_stats: IndexerStats | None = None
        self._handles = [
            ix.module.register_forward_hook(functools.partial(self._on_indexer, i))
            for i, ix in enumerate(self._indexers)
        ]

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """The decoder layer (0-based) of each hooked indexer, in model order."""
        return tuple(ix.layer for ix in self._indexers)

    @property
    def num_layers(self) -> int:
        """The model's decoder layers: the `L` of selections that cover every layer (as SGLang sends)."""
        return self._num_layers

    @property
    def index_topk(self) -> int:
        return self._indexers[0].topk

    @property
    def last_stats(self) -> IndexerStats | None:
        """`IndexerStats` of the last `replay()` block that exited cleanly."""
        return self._last_stats

    def sources(self) -> tuple[int, ...]:
        """For each decoder layer, the hooked layer whose selection it uses (a shared layer: the last before it)."""
        out, last = [], self._indexers[0].layer
        hooked = set(self.indexer_layers)
        for layer in range(self._num_layers):
            if layer in hooked:
                last = layer
            out.append(last)
        return tuple(out)

    @contextlib.contextmanager
    def replay(self, batch: Mapping[str, Any]) -> Iterator[IndexerReplayHook]:
        """Replay `batch`'s selections in every forward of the model inside the block.

        Raises:
            TypeError, ValueError: before the model runs, for a bad layout or
                a bad selection (naming the layer, row and position); inside the
                block, when an indexer sees another `[B, T]` than the batch.
            RuntimeError: when `replay()` or `record()` is already active.
        """
        self._check_idle()
        sel, mask = check_selection_batch(batch)
        B, T, L, K = sel.shape
        if K != self.index_topk:
            raise ValueError(f"{SELECTIONS}: index_topk {K}, the model's indexers select {self.index_topk}")
        columns = self._columns(sel, L)
        check_selection_values(sel if columns == list(range(L)) else sel[:, :, columns], mask, self.indexer_layers)
        device = device_of(self._indexers[0].module)
        # Kept in the batch's compact dtype (no copy on the model's device); each indexer call widens its
        # own layer's rows to the attention's dtype, and nothing more.
        compact = sel.to(device=device, non_blocking=True)
        padding = padding_positions(batch, mask, None, mask_key=SELECTION_MASK, payload="selections")
        self._active = _Replay(
            (B, T),
            first_positions(mask).to(device),
            [compact[:, :, c] for c in columns],
            mask.to(device),
            padding.to(device),
        )
        self._stats.reset()
        restore = self._calls.wrap(ix.layer_module for ix in self._indexers)
        try:
            yield self
            self._last_stats = self._stats.finish(live=self.uncaptured == "live")
        finally:
            self._active = None
            self._calls.restore(restore, only_own=False)

    @contextlib.contextmanager
    def record(self) -> Iterator[Recording]:
        """Record the indexers' own selections in one forward (R2): yields a `torch_r3.replay.Recording`.

        After the block its `batch` is `{"rollout_indexer_topk": [B, T, L, K],
        "indexer_padding_mask": [B, T]}` in the collated layout: `L` every
        decoder layer (a shared layer holds its source's selection, as SGLang
        sends it), positions sorted, `-1` after, the mask `True` where the
        forward's `attention_mask` was 0. Hand it to `replay` in the update.

        Raises:
            RuntimeError: when a block is already active, or the block ran no
                forward or more than one.
        """
        self._check_idle()
        rec, seen = Recording(), _Recorder()
        self._recording = seen
        handle = self._model.register_forward_pre_hook(functools.partial(note_inputs, seen), with_kwargs=True)
        try:
            yield rec
        finally:
            handle.remove()
            self._recording = None
        rec.microbatches.append(self._recorded_batch(seen))

    # ------------------------------------------------------------- internals

    def _columns(self, sel: torch.Tensor, L: int) -> list[int]:
        if L == len(self._indexers):
            return list(range(L))
        if L != self._num_layers:
            raise ValueError(
                f"{SELECTIONS}: {L} layers; expected every decoder layer ({self._num_layers}) "
                f"or the indexer layers only ({len(self._indexers)})"
            )
        for layer, src in enumerate(self.sources()):
            if layer != src and not torch.equal(sel[:, :, layer], sel[:, :, src]):
                raise ValueError(
                    f"{SELECTIONS}: layer {layer} reuses layer {src}'s top-k in this model, but the batch's "
                    "selections for the two differ (captured from a model with another sharing pattern?)"
                )
        return list(self.indexer_layers)

    def _on_indexer(self, index: int, module: torch.nn.Module, args: Any, output: torch.Tensor) -> Any:
        call: dict[int, torch.Tensor] | None = self._calls.current
        if call is not None and index in call:  # activation recompute: exactly the first forward's
            return call[index]
        if self._recording is not None:
            rec = self._recording
            rec.own[index] = output.detach()
            rec.forwards += int(index == 0)
            return None
        state = self._active
        if state is None:
            return None
        B, S, Kp = output.shape
        if (B, S) != state.shape:
            raise ValueError(
                f"layer {self._indexers[index].layer}: the indexer sees [{B}, {S}] queries but the batch covers "
                f"{list(state.shape)} (a forward with a KV cache, or another batch?)"
            )
        replayed = state.columns[index][..., :Kp]
        # Unused slots point at the query itself: selected anyway, so the mask built from them is exact.
        # Built in the attention's dtype: this layer's rows are the only ones widened.
        own_pos = torch.arange(S, device=output.device, dtype=output.dtype).view(1, S, 1)
        out = torch.where(replayed == FILL, own_pos, replayed).to(output.dtype)
        if self.uncaptured == "live":
            out = torch.where(state.uncaptured.unsqueeze(-1), output, out)
        if index == 0:
            self._stats.add_forward(state.uncaptured, state.padding)
        captured = ~state.uncaptured
        own = canonical_rows(output, state.first, Kp)
        self._stats.add_overlap(self._indexers[index].layer, own[captured], replayed[captured])
        if call is not None:
            call[index] = out
        return out

    def _recorded_batch(self, rec: _Recorder) -> dict[str, torch.Tensor]:
        if rec.forwards != 1 or rec.shape is None:
            raise RuntimeError(f"record(): expected exactly one forward of the model in the block, got {rec.forwards}")
        B, T = rec.shape
        mask = rec.mask.cpu() if rec.mask is not None else torch.zeros((B, T), dtype=torch.bool)
        first = first_positions(mask)
        K = self.index_topk
        dtype = torch.int16 if T <= 1 << 15 else torch.int32
        by_layer = {}
        for index, own in rec.own.items():
            by_layer[self._indexers[index].layer] = canonical_rows(own.cpu(), first, K).to(dtype)
        out = torch.stack([by_layer[src] for src in self.sources()], dim=2)
        out[mask] = FILL
        return {SELECTIONS: out, SELECTION_MASK: mask}


class DSAReplayHook(contextlib.AbstractContextManager["DSAReplayHook"]):
    """One hook for both choices of a DSA MoE model: routes in its routers, selections in its indexers.

    ```python
    hook = DSAReplayHook(model)
    with hook.replay(batch):  # routes and selections collated into one batch
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ```

    A DSA model without MoE layers gets the indexer hook alone. `record()`
    yields `(route Recording or None, selection Recording)`.
    """

    def __init__(self, model: torch.nn.Module, *, uncaptured: str = "live"):
        from torch_r3.transformers.families import family_of
        from torch_r3.transformers.hook import ReplayHook

        self.indexers = IndexerReplayHook(model, uncaptured=uncaptured)
        has_routers = any(family_of(m) is not None for m in model.modules())
        self.routes = ReplayHook(model, uncaptured=uncaptured) if has_routers else None

    @contextlib.contextmanager
    def replay(self, batch: Mapping[str, Any]) -> Iterator[DSAReplayHook]:
        """Replay the batch's routes (when the model has routers) and selections inside the block."""
        with contextlib.ExitStack() as stack:
            if self.routes is not None:
                stack.enter_context(self.routes.replay(batch))
            stack.enter_context(self.indexers.replay(batch))
            yield self

    @contextlib.contextmanager
    def record(self) -> Iterator[tuple[Recording | None, Recording]]:
        """Record both choices of one forward (R2)."""
        with contextlib.ExitStack() as stack:
            routes = stack.enter_context(self.routes.record()) if self.routes is not None else None
            yield routes, stack.enter_context(self.indexers.record())

    def close(self) -> None:
        self.indexers.close()
        if self.routes is not None:
            self.routes.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _find_indexers(model: torch.nn.Module) -> tuple[list[_Indexer], int]:
    found, num_layers = find_in_layers(model, lambda name, module: _is_indexer(module), "an indexer")
    if not found:
        raise ValueError(
            f"model ({type(model).__name__}): no DSA indexer found; supported: "
            + ", ".join(cls for _, cls in INDEXER_CLASSES)
        )
    indexers = [_Indexer(f.module, f.name, f.layer, f.layer_module, _index_topk(f.module)) for f in found]
    return indexers, num_layers


def _index_topk(module: Any) -> int:  # a plain attribute nn.Module's typing cannot see
    return int(module.index_topk)
