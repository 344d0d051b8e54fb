"""The collation kernel's input checks: every one passes before the first byte is written.

`check_batch` turns each sample's routes into a canonical `[rows, L, K]` array
and checks its token count; `output_dtype` decides the batch's route dtype (the
samples' dtypes are widened, never narrowed, and the filler's largest expert id
must fit); `check_out` and `check_aliasing` check a caller-supplied `out=`.
Every refusal names the sample (`routes[i]`, `token_counts[i]`) or the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_positive
from torch_r3.collate._samples import SeqField
from torch_r3.keys import ROUTES
from torch_r3.routes import CANONICAL_DTYPES, canonical_dtype_for, compact_routes, first_bad_id, widest

__all__ = ["check_aliasing", "check_batch", "check_out", "output_dtype"]

_COMPACT_ADVICE = (
    "compact it with torch_r3.compact_routes where the routes are made or loaded (on the sender, or in a "
    "datasets set_transform), or pass compact=True to compact at collation"
)


def _as_route_array(sample: Any, i: int, compact: bool = False, num_experts: int | None = None) -> np.ndarray | None:
    """The sample's routes as a canonical array; `None` for an empty sample to reshape once `[L, K]` is known."""
    if isinstance(sample, torch.Tensor):
        if sample.device.type != "cpu":
            raise TypeError(
                f"routes[{i}]: expected a host array, got a tensor on {sample.device}; "
                f"move it with .cpu() (or compact it with torch_r3.compact_routes)"
            )
        sample = sample.detach().numpy()
    if compact and isinstance(sample, (list, tuple)):
        try:
            sample = np.asarray(sample) if len(sample) else np.zeros(0, np.uint8)
        except (ValueError, OverflowError) as e:  # ragged nesting
            raise ValueError(f"routes[{i}]: expected nested lists [rows][layers][topk] of ints: {e}") from None
    if not isinstance(sample, np.ndarray):
        raise TypeError(
            f"routes[{i}]: expected a NumPy array [rows, layers, topk] of uint8/int16/int32, "
            f"got {type(sample).__name__}; {_COMPACT_ADVICE}"
        )
    if compact:
        if sample.size == 0 and sample.ndim != 3:  # an empty list or a datasets object array
            return None
        if sample.dtype not in CANONICAL_DTYPES:
            if sample.dtype.kind not in "iu":
                raise TypeError(f"routes[{i}]: compact=True needs integer expert ids, got dtype {sample.dtype}")
            return compact_routes(sample, name=f"routes[{i}]", num_experts=num_experts, health=None)
    if sample.dtype not in CANONICAL_DTYPES:
        raise ValueError(
            f"routes[{i}]: expected a canonical dtype (native uint8, int16 or int32), got {sample.dtype.str} "
            f"({sample.dtype}); {_COMPACT_ADVICE}"
        )
    if sample.ndim != 3:
        raise ValueError(f"routes[{i}]: expected shape [rows, layers, topk], got {sample.ndim}-D shape {sample.shape}")
    return sample


def _as_count(value: Any, i: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    return check_positive(value, f"token_counts[{i}]")  # the rule of `_checks.check_token_counts`


def check_batch(
    routes: Any, token_counts: Any, *, compact: bool = False, num_experts: int | None = None
) -> tuple[list[np.ndarray], list[int]]:
    """Each sample's routes as a canonical `[rows, L, K]` array and its token count, all checked together.

    `compact=True` compacts integer arrays (and nested lists) that are not canonical yet. With
    `num_experts`, every id is checked against it (a min and a max scan per sample, where the dtype
    leaves them open); without it the values are trusted.
    """
    if isinstance(routes, (np.ndarray, torch.Tensor)) or not isinstance(routes, Sequence):
        raise TypeError(f"routes: expected a sequence of per-trajectory arrays, got {type(routes).__name__}")
    if len(routes) == 0:
        raise ValueError("routes: expected at least one sample, got an empty batch")
    if isinstance(token_counts, torch.Tensor):
        token_counts = token_counts.tolist()
    elif isinstance(token_counts, np.ndarray):
        token_counts = list(token_counts)
    if not isinstance(token_counts, Sequence):
        raise TypeError(f"token_counts: expected a sequence of ints, got {type(token_counts).__name__}")
    if len(token_counts) != len(routes):
        raise ValueError(f"token_counts: expected {len(routes)} counts (one per sample), got {len(token_counts)}")
    found = [_as_route_array(r, i, compact, num_experts) for i, r in enumerate(routes)]
    counts = [_as_count(c, i) for i, c in enumerate(token_counts)]
    shaped = next((a for a in found if a is not None), None)
    if shaped is None:  # only compact=True returns None, for an empty sample
        raise ValueError("routes: every sample is empty, so [layers, topk] is unknown; give one [0, L, K] array")
    arrays = [np.zeros((0,) + shaped.shape[1:], np.uint8) if a is None else a for a in found]
    _, num_layers, topk = arrays[0].shape
    if num_layers == 0 or topk == 0:
        raise ValueError(f"routes[0]: layers and topk must be > 0, got shape {arrays[0].shape}")
    transposed = _layer_major_hint(arrays, counts)
    for i, (a, n) in enumerate(zip(arrays, counts)):
        if a.shape[1:] != (num_layers, topk):
            raise ValueError(
                f"routes[{i}]: expected [rows, {num_layers}, {topk}] like routes[0], got shape {a.shape}{transposed}"
            )
        if a.shape[0] > n:
            raise ValueError(
                f"routes[{i}]: {a.shape[0]} route rows for {n} tokens; captured rows must be a prefix "
                f"of the trajectory's tokens (rows <= tokens){transposed}"
            )
        if num_experts is not None:
            _check_ids(a, i, num_experts)
    return arrays, counts


def _layer_major_hint(arrays: Sequence[np.ndarray], counts: Sequence[int]) -> str:
    """The hint for arrays that read as `[layers, rows, topk]`: each second axis its trajectory's row count.

    A layer-major array of a trajectory of `n` tokens has `n - 1` (or `n`) on its second axis; the
    hint is added to a shape refusal where every non-empty sample fits that reading and the layer
    axes agree. It never refuses on its own: a batch of equal lengths whose arrays fit both readings
    (rows of a partial capture, as many layers as tokens) is valid as `[rows, layers, topk]`.
    """
    shaped = [(a, n) for a, n in zip(arrays, counts) if a.shape[0] > 0]
    if not shaped or len({(a.shape[0], a.shape[2]) for a, _ in shaped}) != 1:
        return ""
    if not all(a.shape[1] in (n - 1, n) for a, n in shaped):
        return ""
    return (
        "; is the array [layers, rows, topk]? Its second axis matches the token count: routes are "
        "[rows, layers, topk], e.g. routes.transpose(1, 0, 2) (or np.moveaxis(routes, 0, 1))"
    )


def _check_ids(routes: np.ndarray, i: int, num_experts: int) -> None:
    index = first_bad_id(routes, num_experts)
    if index is not None:
        row, layer, _ = index
        raise ValueError(
            f"routes[{i}] (sample {i}): row {row}, layer {layer}: expert id {int(routes[index])} is outside "
            f"[0, num_experts={num_experts})"
        )


def output_dtype(
    arrays: Sequence[np.ndarray], topk: int, *, filler: str, num_experts: int | None, dtype: np.dtype | None
) -> np.dtype:
    """The batch's route dtype: `dtype` when given (checked against every sample and the filler), else the widest."""
    # Promotion by dtype alone (the sender compacted, no value is rescanned),
    # widened where a padding expert id would not fit the inputs' dtype.
    experts = num_experts  # set whenever padding is balanced (checked by the kernel's options)
    if filler == "zeros":
        largest_pad_id = 0
    else:
        largest_pad_id = experts - 1 if filler == "balanced" and experts is not None else topk - 1
    pad_dtype = canonical_dtype_for(largest_pad_id)
    if dtype is None:
        return widest({a.dtype for a in arrays} | {pad_dtype})
    rank = CANONICAL_DTYPES.index
    for i, a in enumerate(arrays):
        if rank(a.dtype) > rank(dtype):
            raise ValueError(
                f"routes[{i}]: dtype {a.dtype} is wider than dtype={dtype}; routes are widened, never "
                f"narrowed: pass the global batch's dtype (torch_r3.global_geometry)"
            )
    if rank(pad_dtype) > rank(dtype):
        raise ValueError(
            f"dtype={dtype} cannot hold the {filler} filler's expert id {largest_pad_id}; use dtype={pad_dtype}"
        )
    return dtype


def check_aliasing(result: dict[str, torch.Tensor], arrays: Sequence[np.ndarray], fields: Sequence[SeqField]) -> None:
    """Refuse an input that lives inside a caller-supplied output (it would be overwritten before it is read)."""
    for key, t in result.items():
        view = t.numpy()
        for i, a in enumerate(arrays):
            if np.may_share_memory(a, view):
                raise ValueError(f"routes[{i}] lies in the memory of out[{key!r}]; collate from a copy of it")
        for f in fields:
            for i, a in enumerate(f.arrays):
                if np.may_share_memory(a, view):
                    raise ValueError(f"sample {i}: {f.key!r} lies in the memory of out[{key!r}]; use a copy of it")


def check_out(out: Any, want: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    if out is None:
        return {}
    if isinstance(out, torch.Tensor):
        out = {ROUTES: out}
    if not isinstance(out, Mapping):
        raise TypeError(f"out: expected a tensor (for {ROUTES}) or a dict of tensors, got {type(out).__name__}")
    for key, t in out.items():
        if key not in want:
            raise ValueError(f"out: unexpected key {key!r}; expected some of {sorted(want)}")
        shape, dtype = want[key]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"out[{key!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"out[{key!r}]: expected shape {list(shape)} and dtype {dtype}, "
                f"got shape {list(t.shape)} and dtype {t.dtype}"
            )
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"out[{key!r}]: expected a contiguous CPU tensor, got device {t.device}, contiguous={t.is_contiguous()}"
            )
    return dict(out)
