"""`IndexerReplayHook`: replay a batch's DSA indexer selections in one Megatron model, microbatch by microbatch.

Megatron-core 0.19's `DSAttention.forward` (module
`megatron.core.transformer.experimental_attention_variant.dsa`) never calls
`DSAIndexer.forward`: it asks the indexer for `q, k, weights` only
(`self.indexer.forward_before_topk`) and computes the top-k itself, through
the module-level `fused_qk_topk_naive` on the unfused path, directly or
inside the indexer loss (`fwd_fused_indexer_loss_naive`). The fused kernels
(`dsa_kernel_backend="tilelang"`/`"cudnn"`) compute it inside CUDA code with
no Python seam. So the one place a top-k can be replaced for one layer is that
function's call during that layer's forward, and the hook does exactly that:

* it wraps each computing `DSAttention` instance's `forward` (an instance
  attribute, never the class); during a step the wrapper rebinds
  `dsa.fused_qk_topk_naive` to a replaying function for the length of that
  one call and restores it in `finally`, so other instances, other models and
  calls outside a step see Megatron's function;
* the replaying function calls Megatron's own top-k (for uncaptured queries
  and the drift statistics) and returns the microbatch's selection for
  captured queries: the sparse attention, the indexer loss and the layers that
  share this layer's top-k (`dsa_indexer_topk_freq > 1`) all use it;
* a layer that ran its forward without consulting the function (a fused
  kernel, a changed Megatron) raises instead of silently attending live.

The microbatch contract is `torch_r3.megatron.ReplayHook`'s, written once in
`torch_r3.megatron.schedule`: `step()` / `wrap_forward_step()` /
`forward_backward()` (or `begin_microbatch()` / `end_microbatch()` around a
forward step that cannot be wrapped), every stage's data iterator
yields the collated microbatch dicts, the selections are checked before the
model runs (positions causal and in range, distinct, `min(index_topk, seen)`
of them), activation recompute replays what the forward used, and the
interleaved schedule is refused. For a DSA MoE model, wrap the forward step
with both hooks (`routes.wrap_forward_step(indexer.wrap_forward_step(fn))`)
inside both steps: each takes the one microbatch dict its inner step is
handed.

Context parallelism (Megatron's allgather DSA): a rank keeps the query rows of
its two sequence chunks; the positions still name the whole sequence's keys,
so the rows are cut and the values kept (`context_parallel_positions`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_r3.collate.selections import SELECTION_MASK, SELECTIONS
from torch_r3.keys import CU_SEQLENS
from torch_r3.megatron.dsa import (
    DSA_MODULE,
    TOPK_FUNCTION,
    check_dsa_config,
    context_parallel_rank,
    dsa_module,
    query_rows,
    selections_for_rank,
    topk_sharing,
)
from torch_r3.megatron.model import as_chunks, first_device, model_config, stage_layers
from torch_r3.megatron.schedule import MicrobatchSchedule, next_recompute
from torch_r3.megatron.setup_checks import check_pipeline
from torch_r3.replay import marker
from torch_r3.replay.modes import check_uncaptured
from torch_r3.replay.padding import padding_positions
from torch_r3.replay.selection_checks import check_selection_batch, check_selection_values
from torch_r3.replay.selection_stats import IndexerStats, SelectionStatsCollector

# DSA_MODULE, TOPK_FUNCTION, dsa_module and selections_for_rank are defined in torch_r3.megatron.dsa
__all__ = [
    "DSA_MODULE",
    "TOPK_FUNCTION",
    "IndexerReplayHook",
    "dsa_module",
    "selections_for_rank",
]

# The refusal of a recompute with nothing left to replay (`next_recompute` formats it).
_NO_RECOMPUTE = (
    "layer {layer}: DSAttention ran outside the forward step with no microbatch left to "
    "recompute ({pushes} installed, {pops} recomputed); run the model only inside "
    "forward_step_func"
)


@dataclass
class _Layer:
    module: torch.nn.Module
    name: str
    layer: int  # global, 0-based
    source: int  # the global layer whose top-k it uses (itself when it computes one)
    recomputed: bool  # does full activation recompute re-run it in backward?
    column: int = -1  # index into the batch's L (computing layers only)
    queue: list[torch.Tensor] = field(default_factory=list)
    consults: int = 0
    pushes: int = 0
    pops: int = 0

    @property
    def computes(self) -> bool:
        return self.source == self.layer


@dataclass
class _Microbatch:
    index: int
    columns: list[
        torch.Tensor
    ]  # per computing layer: [B, S, K] in the batch's compact dtype, canonical, this rank's rows
    uncaptured: torch.Tensor  # [B, S] bool
    recompute: bool  # will backward recompute the recomputed layers?


class IndexerReplayHook(MicrobatchSchedule):
    """Replays captured DSA indexer selections in one Megatron model's `DSAttention` layers.

    ```python
    hook = IndexerReplayHook(model)
    with hook.step():
        losses = forward_backward_func(forward_step_func=hook.wrap_forward_step(forward_step), ...)
    ```

    Each microbatch dict holds `rollout_indexer_topk` (`[B, T, L, K]` in batch
    positions, `torch_r3.indexer.collate_selections` with the padded layout)
    and `indexer_padding_mask` (`[B, T]`, `True` where no selection was
    captured); a packed microbatch (`cu_seqlens`) is refused. Every rank gets
    the whole microbatch: the hook keeps this context-parallel rank's rows.
    `T` must be the model's sequence length.

    The rebinding of `fused_qk_topk_naive` lasts one layer's forward and is
    process-wide for that time: another thread running Megatron DSA in the
    same process at that moment would see it (and is refused by its own hook,
    if it has one).

    Args:
        model: A Megatron module (`GPTModel` with DSA attention, possibly
            wrapped in DDP or `Float16Module`) or a list of exactly one chunk.
        config: The model's `TransformerConfig`; by default the chunk's `.config`.
        uncaptured: Queries without a captured selection (left padding, the
            last token): `"live"` (default) uses the layer's own top-k,
            `"replay"` lets each attend to itself only.
        selection_layers: The global layer (0-based) each index of the
            selections' `L` holds. Without it `L` is told apart by its size:
            every decoder layer (`num_layers`; a sharing layer's column must equal
            its source's) or the computing layers only (layers with an indexer).

    Raises:
        ImportError: This megatron-core has no DSA (see `dsa_module`).
        InterleavedPipelineError: The virtual pipeline schedule, as `ReplayHook`.
        ValueError: No `DSAttention` in the model (or no
            `experimental_attention_variant="dsa"`), a fused DSA kernel
            backend (it computes the top-k in CUDA code the hook cannot
            reach), a CUDA graph, `selection_layers` without one of this
            stage's indexer layers, another hook on a layer, a bad `uncaptured`.
        TypeError: `model` is not a module or a list of modules.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        config: Any | None = None,
        *,
        uncaptured: str = "live",
        selection_layers: Sequence[int] | None = None,
    ):
        super().__init__()
        self._dsa = dsa_module()
        chunks = as_chunks(model)
        config = model_config(chunks, config)
        self.uncaptured = check_uncaptured(uncaptured)
        check_pipeline(config, len(chunks))
        check_dsa_config(config, self._dsa)
        self.config = config
        self._chunk = chunks[0]
        self._num_layers = int(config.num_layers)
        offset, freq = topk_sharing(config)
        self._computing = tuple(
            g for g in range(self._num_layers) if freq == 1 or not self._dsa.is_dsa_skip_topk_layer(g + 1, offset, freq)
        )
        self._layers = self._find_layers(config)
        for entry in self._layers:
            marker.check_free(entry.module, entry.name)
        self._columns = self._column_map(selection_layers)
        self._original_topk = getattr(self._dsa, TOPK_FUNCTION)
        self._current: _Microbatch | None = None
        self._stats = SelectionStatsCollector()
        self._last_stats: IndexerStats | None = None
        self._attached = True
        for entry in self._layers:
            marker.claim(entry.module, entry.name)
            if entry.computes:
                vars(entry.module)["forward"] = self._wrapped_forward(entry, entry.module.forward)

    # ----------------------------------------------------------------- public

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Global layers (0-based) of this stage whose `DSAttention` computes a top-k, in model order."""
        return tuple(e.layer for e in self._layers if e.computes)

    @property
    def layers(self) -> tuple[int, ...]:
        """Global layers (0-based) of this stage's `DSAttention` layers, sharing layers included."""
        return tuple(e.layer for e in self._layers)

    @property
    def index_topk(self) -> int:
        return int(self.config.dsa_indexer_topk)

    @property
    def last_stats(self) -> IndexerStats | None:
        """`IndexerStats` of the last step that completed (overlap per computing layer, rows, forwards)."""
        return self._last_stats

    def sources(self) -> dict[int, int]:
        """For each of this stage's DSA layers, the global layer whose top-k it uses."""
        return {e.layer: e.source for e in self._layers}

    def forward_backward(self, forward_backward_func: Callable | None = None, **kwargs: Any) -> Any:
        """Run one step of Megatron's schedule with replay (`ReplayHook.forward_backward`'s contract)."""
        return self._run_schedule(forward_backward_func, kwargs)

    @contextlib.contextmanager
    def step(self, *, forward_only: bool = False, num_microbatches: int | None = None) -> Iterator[IndexerReplayHook]:
        """Bracket one `forward_backward` call; on a clean exit check recompute and set `last_stats`.

        Raises:
            RuntimeError: A recomputed layer was re-run another number of times
                than its microbatches, steps nest, or the hook is closed.
        """
        with self._stepping(forward_only=forward_only, num_microbatches=num_microbatches):
            yield self

    # --------------------------------------------------------------- internals

    @property
    def _closed(self) -> bool:
        return not self._attached

    def _finish_microbatch(self) -> None:
        self._current = None

    def _finish_step(self) -> None:
        self._check_drained()
        self._last_stats = self._stats.finish(live=self.uncaptured == "live")

    def _detach(self) -> None:
        # The layers get Megatron's own forward back.
        if self._attached:
            for entry in self._layers:
                vars(entry.module).pop("forward", None)
                marker.release(entry.module)
        self._attached = False

    def _find_layers(self, config: Any) -> list[_Layer]:
        stage = stage_layers(self._chunk, config)
        granularity = getattr(config, "recompute_granularity", None)
        method = getattr(config, "recompute_method", None)
        found = []
        for name, module in self._chunk.named_modules():
            if not isinstance(module, self._dsa.DSAttention):
                continue
            parts = name.split(".")
            if "mtp" in parts:
                continue  # multi-token prediction layers attend with their own top-k
            local = next(
                (
                    int(c)
                    for a, b, c in zip(parts, parts[1:], parts[2:])
                    if (a, b) == ("decoder", "layers") and c.isdigit()
                ),
                None,
            )
            if local is None:
                raise ValueError(f"model: the DSAttention {name!r} is not in decoder.layers; cannot tell its layer")
            layer = int(module.layer_number) - 1
            if layer not in stage:
                raise ValueError(
                    f"{name}: layer {layer} is outside this stage's layers {stage.start}..{stage.stop - 1}"
                )
            recomputed = granularity == "full" and (method != "block" or local < (config.recompute_num_layers or 0))
            found.append(_Layer(module, name, layer, int(module.source_layer) - 1, recomputed))
        if not found:
            raise ValueError(
                "model: no DSAttention layer found; build the model with experimental_attention_variant='dsa' "
                "(megatron-core's get_transformer_layer_with_experimental_attention_variant_spec)"
            )
        return found

    def _column_map(self, selection_layers: Sequence[int] | None) -> tuple[int, int | None]:
        """Set each computing layer's column; return the `L` the batch must have (and `None` or `num_layers`)."""
        if selection_layers is not None:
            held = [int(x) for x in selection_layers]
            for entry in self._layers:
                if entry.computes:
                    if entry.layer not in held:
                        raise ValueError(
                            f"selection_layers={held} does not hold layer {entry.layer}, whose indexer this stage replays"
                        )
                    entry.column = held.index(entry.layer)
            return len(held), None
        for entry in self._layers:
            if entry.computes:
                entry.column = self._computing.index(entry.layer)
        return len(self._computing), self._num_layers

    def _columns_for(self, L: int) -> list[int]:
        fixed, every = self._columns
        if L == fixed:
            return [e.column for e in self._layers if e.computes]
        if every is not None and L == every:
            return [e.layer for e in self._layers if e.computes]
        expect = (
            f"{fixed} (selection_layers)"
            if every is None
            else f"{every} (every layer) or {fixed} (the layers with an indexer)"
        )
        raise ValueError(f"{SELECTIONS} has {L} layers; expected {expect}")

    def _install(self, batch: Mapping[str, Any], index: int) -> None:
        prefix = f"microbatch {index}, "
        if isinstance(batch, Mapping) and CU_SEQLENS in batch:
            raise ValueError(
                f"{prefix}packed microbatch (cu_seqlens): IndexerReplayHook replays the padded layout only; "
                "collate the selections with layout='padded'"
            )
        try:
            sel, mask = check_selection_batch(batch)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{prefix}{err}") from None
        B, T, L, K = sel.shape
        if K != self.index_topk:
            raise ValueError(f"{prefix}{SELECTIONS}: index_topk {K}, the model's dsa_indexer_topk is {self.index_topk}")
        columns = self._columns_for(L)
        if self._columns[1] is not None and L == self._columns[1]:
            for entry in self._layers:
                if not entry.computes and not torch.equal(sel[:, :, entry.layer], sel[:, :, entry.source]):
                    raise ValueError(
                        f"{prefix}{SELECTIONS}: layer {entry.layer} reuses layer {entry.source}'s top-k in this "
                        "model (dsa_indexer_topk_freq), but the batch's selections for the two differ"
                    )
        device = first_device(self._chunk)
        sel = sel.to(device, non_blocking=True)
        if columns != list(range(L)):
            sel = sel[:, :, columns]
        mask = mask.to(device, non_blocking=True)
        check_selection_values(sel, mask, self.indexer_layers, prefix=prefix)
        try:
            padding = padding_positions(batch, mask, None, mask_key=SELECTION_MASK, payload="selections")
        except (TypeError, ValueError) as err:
            raise type(err)(f"{prefix}{err}") from None
        wide, mask, positions = selections_for_rank(sel, mask, *context_parallel_rank(), uncaptured=self.uncaptured)
        recompute = torch.is_grad_enabled() and not self._forward_only and self._chunk.training
        self._stats.add_forward(mask, padding[:, positions])
        self._current = _Microbatch(index, [wide[:, :, j] for j in range(len(columns))], mask, recompute)

    def _wrapped_forward(self, entry: _Layer, original: Callable) -> Callable:
        j = [e for e in self._layers if e.computes].index(entry)

        def replaying_topk(*args: Any, **kwargs: Any) -> Any:
            scores, own = self._original_topk(*args, **kwargs)
            return scores, self._choose(entry, j, own)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                return original(*args, **kwargs)
            current = getattr(self._dsa, TOPK_FUNCTION)
            if current is not self._original_topk:
                raise RuntimeError(
                    f"{entry.name}: {DSA_MODULE}.{TOPK_FUNCTION} is not Megatron's function during this call "
                    "(another replay hook, or a patch of it, is active); one hook per model, no nested forwards"
                )
            before = entry.consults
            setattr(self._dsa, TOPK_FUNCTION, replaying_topk)
            try:
                out = original(*args, **kwargs)
            finally:
                setattr(self._dsa, TOPK_FUNCTION, current)
            if entry.consults == before:
                raise RuntimeError(
                    f"{entry.name} (layer {entry.layer}): DSAttention ran without computing its top-k through "
                    f"{TOPK_FUNCTION}, so it attended with a top-k the hook could not replay (a fused DSA kernel, "
                    "or a megatron-core whose DSAttention changed)"
                )
            return out

        return forward

    def _choose(self, entry: _Layer, j: int, own: torch.Tensor) -> torch.Tensor:
        entry.consults += 1
        mb = self._current
        if mb is None:  # in the step but outside a forward step: activation recompute
            chosen = next_recompute(entry.queue, _NO_RECOMPUTE, layer=entry.layer, pushes=entry.pushes, pops=entry.pops)
            entry.pops += 1
            if chosen.shape != own.shape:
                raise RuntimeError(
                    f"layer {entry.layer}: recompute sees top-k {list(own.shape)}, the forward {list(chosen.shape)}"
                )
            return chosen.to(own.dtype)
        replayed = mb.columns[j]
        B, S, Kp = own.shape
        rows = query_rows(replayed.shape[1], S, mb.index, entry.layer)
        replayed, uncaptured = replayed[:, rows, :Kp], mb.uncaptured[:, rows]
        if replayed.shape[0] != B:
            raise ValueError(
                f"microbatch {mb.index}, layer {entry.layer}: the layer sees [{B}, {S}] queries but the batch "
                f"covers [{replayed.shape[0]}, {mb.uncaptured.shape[1]}] on this rank (another batch?)"
            )
        # The selections stay compact up to here: the attention's scatter gets this layer's rows in its dtype.
        if self.uncaptured == "live":
            chosen = torch.where(uncaptured.unsqueeze(-1), own, replayed)
        else:
            chosen = replayed.to(own.dtype)
        captured = ~uncaptured
        if bool(captured.any()):
            self._stats.add_overlap(entry.layer, own[captured], replayed[captured])
        if entry.recomputed and mb.recompute:
            entry.queue.append(chosen.to(replayed.dtype))  # compact until its recompute widens it again
        entry.pushes += 1
        return chosen

    def _check_drained(self) -> None:
        wrong = [
            f"layer {e.layer}: {len(e.queue)} microbatches left unrecomputed"
            for e in self._layers
            if e.computes and e.queue
        ]
        if wrong:
            raise RuntimeError(
                "activation recompute did not re-run every recomputed DSA layer once per microbatch: "
                + "; ".join(wrong)
            )

    def _clear(self) -> None:
        self._current = None
        self._stats.reset()
        for e in self._layers:
            e.queue.clear()
            e.consults = e.pushes = e.pops = 0
