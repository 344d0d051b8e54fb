"""SkyRL's Megatron worker side: its per-microbatch replay set-up, replaced by `torch_r3.megatron.ReplayHook`.

SkyRL 0.4.0's Megatron worker replays routes through its own
`setup_per_microbatch_replay_forward` and `router_replay_schedule`
(`backends/skyrl_train/utils/replay_utils.py`): it aligns the packed routes to
the model's token layout (`distributed/megatron/token_metadata.py`), slices them
for tensor parallelism, hands them to Megatron's `RouterReplay`, and patches
`TopKRouter.set_layer_number` to map dense-first models' layers. Nothing checks
the routes at use, nothing reports drift, and a router that skipped replay goes
unnoticed.

`microbatch` takes one micro-batch in SkyRL's batch form (a `TrainingInputBatch`
chunk: left-padded `sequences` and `attention_mask`, the packed
`rollout_expert_indices` and the left-padded `router_padding_mask` of
`torch_r3.integrations.skyrl.controller`) and collates it, in one write, into
the batch `torch_r3.megatron.ReplayHook` replays, in the token layout SkyRL's
Megatron model gets: right-padded to a multiple (`remove_left_padding`), or
packed with each sequence aligned (`cu_seqlens_padded`,
`remove_microbatch_padding=True`). The routes and router mask are bit-identical
to what SkyRL's `align_token_metadata` / `align_packed_token_metadata` make; the
hook then does what the replaced SkyRL functions did (layer selection for
pipeline stages and dense-first models, sequence- and context-parallel slicing,
the FIFO for recompute), plus validation at use, live routing of uncaptured
tokens, drift statistics and the skipped-replay tripwire.

One difference, on purpose: SkyRL passes its router padding mask as the model's
`padding_mask`, so real tokens without a captured route (the last sampled token)
leave the routers' load-balancing counts; the hook's `padding_mask` is the true
padding only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from torch_r3.collate.collator import R3Collator
from torch_r3.collate.layout import Memory, Packed, Padded, from_keywords
from torch_r3.integrations.skyrl.controller import left_padded_lengths
from torch_r3.keys import ATTENTION_MASK, CU_SEQLENS, INPUT_IDS, ROUTER_MASK, ROUTES, SAMPLE_ROUTES

__all__ = ["SEQUENCES", "microbatch", "microbatches"]

SEQUENCES = "sequences"
"""SkyRL's `TrainingInputBatch` key for the left-padded token ids."""


def _field(batch: Any, key: str) -> Any:
    try:
        value = batch[key]
    except (KeyError, TypeError):
        value = None
    if value is None:
        raise ValueError(f"batch: missing {key!r} (a SkyRL TrainingInputBatch with routed-expert replay has it)")
    return value


def _check_router_mask(mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row of SkyRL's left-padded router mask: True on the padding, then captured (False), then True.

    Returns:
        Each trajectory's captured rows, `[B]` (a prefix of its real tokens).
    """
    b, t = mask.shape
    positions = torch.arange(t, device=mask.device)
    start = (t - lengths).unsqueeze(1)
    real = positions >= start
    bad = (~(mask | real)).any(1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{ROUTER_MASK}[{i}]: expected True on the left padding, got {mask[i].int().tolist()}")
    captured = (~mask).sum(1)
    prefix = real & (positions < start + captured.unsqueeze(1))
    bad = (prefix != ~mask).any(1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{ROUTER_MASK}[{i}]: its captured tokens are not a prefix of the trajectory "
            f"(False then True over the real tokens), got {mask[i, t - int(lengths[i]) :].int().tolist()}"
        )
    return captured


def _check_packed(values: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """SkyRL's `PackedTensor` invariant, checked again: an object changed after construction can break it."""
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"{ROUTES}: expected 1-D integer cu_seqlens of at least 2 offsets, got {cu_seqlens!r}")
    if values.ndim != 3:
        raise ValueError(f"{ROUTES}: expected values [tokens, L, K], got shape {list(values.shape)}")
    ends = cu_seqlens.tolist()
    if ends[0] != 0 or any(b < a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"{ROUTES}: cu_seqlens must start at 0 and never decrease, got {ends}")
    rows = values.shape[0]
    for i in range(len(ends) - 1):
        if ends[i + 1] > rows:
            raise ValueError(
                f"{ROUTES}: trajectory {i}'s segment [{ends[i]}, {ends[i + 1]}) ends past the {rows} value rows"
            )
    if ends[-1] != rows:
        raise ValueError(f"{ROUTES}: cu_seqlens end at {ends[-1]}, the values hold {rows} rows")


#: SkyRL's unpacked micro-batch layout (`remove_left_padding`): right-padded.
SKYRL_PADDED = Padded(side="right")


def _layout(layout: Any, memory: Any, deprecated: dict[str, Any]) -> tuple[Padded | Packed, Memory]:
    """`microbatch`'s layout and memory, its old `packed=` / `pad_to_multiple_of=` / `buffers=` folded in (warned)."""
    keywords = ("packed", "pad_to_multiple_of", "buffers")
    value, memory = from_keywords(
        "microbatch", layout, memory, deprecated, keywords=keywords, allowed=(Padded, Packed), default=SKYRL_PADDED
    )
    assert isinstance(value, (Padded, Packed))  # allowed= above
    return value, memory.with_defaults(pin_memory=False)


def microbatch(
    batch: Any,
    *,
    layout: Padded | Packed | str = SKYRL_PADDED,
    pad_token_id: int = 0,
    memory: Memory | None = None,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """One SkyRL micro-batch as the batch `torch_r3.megatron.ReplayHook` replays.

    Args:
        batch: a SkyRL `TrainingInputBatch` (or mapping) with `sequences`
            `[B, T]`, `attention_mask` `[B, T]` (left-padded),
            `rollout_expert_indices` (SkyRL's `PackedTensor`, one segment of
            `n_i` rows per trajectory) and `router_padding_mask` `[B, T]`.
        layout: SkyRL's micro-batch layout, with its alignment unit (its
            `get_unpacked_seq_align_size` / `get_packed_seq_align_size` for the
            run's TP, CP and FP8 settings) as `pad_to_multiple_of`: by default
            `torch_r3.Padded(side="right")`, right-padded `[B, T', L, K]`
            (`remove_left_padding`); `torch_r3.Packed(pad_to_multiple_of=)` is
            its `remove_microbatch_padding=True` layout (THD), `[sum(n'), L, K]`
            with `cu_seqlens` and `cu_seqlens_padded`.
        pad_token_id: the id written into padded `input_ids` (SkyRL's
            `remove_left_padding` writes 0).
        memory: a `torch_r3.Memory`; its `buffers`, a `torch_r3.BufferPool` to
            take the batch from (recycled across micro-batches); by default
            fresh, unpinned memory.
        **deprecated: `packed=`, `pad_to_multiple_of=` and `buffers=`, each
            with a `DeprecationWarning` naming the new spelling.

    Returns:
        `input_ids`, `rollout_expert_indices`, `router_padding_mask`, and
        `attention_mask` (padded) or `cu_seqlens` and `cu_seqlens_padded`
        (packed; `cu_seqlens_padded` only with `pad_to_multiple_of`).

    Raises:
        TypeError: a field of the wrong kind.
        ValueError: a missing field, shapes that do not agree, packed values
            shorter or longer than their `cu_seqlens` say, a mask that is not
            left-padded, or captured rows that are not a prefix of a
            trajectory's tokens (naming the trajectory).
    """
    layout, memory = _layout(layout, memory, deprecated)
    fields = _checked_fields(batch)
    samples = []
    t = fields.attention.shape[1]
    starts = fields.cu_seqlens.tolist()
    host = fields.values.cpu()
    for i, (n, captured) in enumerate(zip(fields.lengths.tolist(), fields.captured.tolist())):
        samples.append(
            {
                INPUT_IDS: fields.sequences[i, t - n :],
                SAMPLE_ROUTES: host[starts[i] : starts[i] + captured].numpy(),
            }
        )
    collator = R3Collator(layout=layout, pad_token_id=pad_token_id, filler="arange", memory=memory)
    return collator(samples)


@dataclasses.dataclass(frozen=True)
class _Fields:
    sequences: torch.Tensor
    attention: torch.Tensor
    values: torch.Tensor  # the PackedTensor's
    cu_seqlens: torch.Tensor
    mask: torch.Tensor  # router_padding_mask, [B, T]
    lengths: torch.Tensor  # real tokens per trajectory, [B]
    captured: torch.Tensor  # captured rows per trajectory (a prefix), [B]


def _checked_fields(batch: Any) -> _Fields:
    """A SkyRL micro-batch's fields, each checked against the others (what `microbatch` documents it raises)."""
    sequences = _field(batch, SEQUENCES)
    attention = _field(batch, ATTENTION_MASK)
    routes = _field(batch, ROUTES)
    mask = _field(batch, ROUTER_MASK)
    lengths = left_padded_lengths(attention)
    b, t = attention.shape
    for key, value in ((SEQUENCES, sequences), (ROUTER_MASK, mask)):
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (b, t):
            what = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{key}: expected a [B, T] = {[b, t]} tensor like attention_mask, got {what}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{ROUTER_MASK}: expected a bool tensor, got {mask.dtype}")
    values, cu_seqlens = getattr(routes, "values", None), getattr(routes, "cu_seqlens", None)
    if not isinstance(values, torch.Tensor) or not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{ROUTES}: expected SkyRL's PackedTensor (values, cu_seqlens), got {type(routes).__name__}")
    _check_packed(values, cu_seqlens)
    segments = cu_seqlens.diff().tolist()
    if segments != lengths.tolist():
        raise ValueError(
            f"{ROUTES}: its segments hold {segments} rows, the trajectories have {lengths.tolist()} tokens"
        )
    captured = _check_router_mask(mask, lengths)
    return _Fields(sequences, attention, values, cu_seqlens, mask, lengths, captured)


def packed_view(batch: Any) -> dict[str, torch.Tensor] | None:
    """`microbatch(batch, layout=Packed())` without a copy, where SkyRL's batch already holds that layout.

    SkyRL's packed routes are one segment of `n_i` rows per trajectory, the
    trajectories' real tokens back to back: the packed layout itself. When the
    uncaptured rows of every segment already hold the filler `microbatch`
    writes (experts `0..K-1`, as SkyRL's and `torch_r3`'s controller collation
    leave them), the routes are SkyRL's own tensor and `cu_seqlens` its own
    (`int32`); the router mask is cut from the `[B, T]` one (a view for one
    trajectory). Every check of `microbatch` runs first.

    Returns:
        `rollout_expert_indices`, `router_padding_mask`, `cu_seqlens`, and
        `input_ids` (`[N]`), equal to `microbatch(batch, layout=Packed())`'s;
        `None` when an uncaptured row holds anything else (`microbatch` then
        writes the filler in a copy).

    Raises:
        TypeError, ValueError: as `microbatch`.
    """
    fields = _checked_fields(batch)
    b, t = fields.attention.shape
    if b == 1:
        real = slice(t - int(fields.lengths[0]), t)
        mask, ids = fields.mask[0, real], fields.sequences[0, real]
    else:
        keep = fields.attention != 0
        mask, ids = fields.mask[keep], fields.sequences[keep]
    values = fields.values
    uncaptured = values[mask]
    filler = torch.arange(values.shape[-1], device=values.device).to(values.dtype)
    if uncaptured.numel() and not bool((uncaptured == filler).all()):
        return None
    return {ROUTES: values, ROUTER_MASK: mask, CU_SEQLENS: fields.cu_seqlens.to(torch.int32), INPUT_IDS: ids}


def microbatches(batches: Iterable[Any], **options: Any) -> Iterator[dict[str, torch.Tensor]]:
    """`microbatch(b, **options)` for each of SkyRL's micro-batches (`mini_batch.chunk(micro_batch_size)`).

    The iterator a `ReplayHook` step's `data_iterator` takes.
    """
    for b in batches:
        if not isinstance(b, Mapping) and not hasattr(b, "__getitem__"):
            raise TypeError(f"batches: expected SkyRL TrainingInputBatch chunks, got {type(b).__name__}")
        yield microbatch(b, **options)
