"""A batch's geometry from metadata alone: its length, dtype, layers and size bound.

Every rank of a data-parallel job can compute the global batch's `seq_len` and
route dtype from the trajectories' token counts and route dtypes, without any
route bytes (`global_geometry`), and pass them to its own collator so that its
micro-batches are slices of the global batch. The argument rules of the
collation kernel's geometry (`dtype=`, `keep_layers=`, `sample_ids=`, prompt
lengths and the output-size bound) live here (the layout's own, `Padded(seq_len=)`
and the rest, in `torch_r3.collate.layout`), one rule per kind of argument.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_dtype, check_indices, check_int, check_positive, check_token_counts
from torch_r3._deprecation import renamed_argument
from torch_r3.collate._filler import check_filler
from torch_r3.collate.layout import Packed, Padded, from_keywords
from torch_r3.routes import CANONICAL_DTYPES, canonical_dtype_for, widest

# The `check_*` helpers and the output-size bound are shared with the collators,
# not offered to users.
__all__ = ["BatchGeometry", "global_geometry", "padded_length"]

#: Exclusive bound of a sample's row in the global batch (`sample_ids=`).
MAX_SAMPLE_ID = 2**62

#: Environment variable overriding the default output-size bound (bytes).
MAX_OUTPUT_BYTES_ENV = "TORCH_R3_MAX_OUTPUT_BYTES"


def check_route_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """A requested route dtype (NumPy, torch or a string) as one of `CANONICAL_DTYPES`."""
    return check_dtype(dtype, name, CANONICAL_DTYPES)


def check_layers(layers: Any, name: str = "layers") -> tuple[int, ...]:
    """`keep_layers=`: a non-empty sequence of distinct non-negative ints (the range is checked against the routes)."""
    return check_indices(layers, name, what="layer index")


def check_layers_in_range(layers: tuple[int, ...], num_layers: int) -> None:
    """Every index of `layers` names a layer of routes with `num_layers` layers."""
    for k, v in enumerate(layers):
        if v >= num_layers:
            raise ValueError(f"keep_layers[{k}]: layer {v} is out of range for routes with {num_layers} layers")


def check_sample_ids(sample_ids: Any, batch_size: int) -> list[int]:
    """`sample_ids=`: one distinct non-negative int per sample (its row in the global batch)."""
    ids = check_indices(sample_ids, "sample_ids", limit=MAX_SAMPLE_ID, what="id")
    if len(ids) != batch_size:
        raise ValueError(f"sample_ids: expected {batch_size} ids (one per sample), got {len(ids)}")
    return list(ids)


def check_prompt_lengths(prompt_lengths: Any, counts: Sequence[int], width: int, response_width: int) -> list[int]:
    """Each sample's prompt token count `p_i`, with `p_i <= width` and `n_i - p_i <= response_width`."""
    if prompt_lengths is None:
        raise ValueError("layout=torch_r3.PromptResponse(...) needs each sample's prompt length (prompt_lengths=)")
    if isinstance(prompt_lengths, (torch.Tensor, np.ndarray)):
        prompt_lengths = prompt_lengths.tolist()
    if isinstance(prompt_lengths, (str, bytes)) or not isinstance(prompt_lengths, Sequence):
        raise TypeError(f"prompt_lengths: expected a sequence of ints, got {type(prompt_lengths).__name__}")
    if len(prompt_lengths) != len(counts):
        raise ValueError(f"prompt_lengths: expected {len(counts)} lengths (one per sample), got {len(prompt_lengths)}")
    out = []
    for i, (p, n) in enumerate(zip(prompt_lengths, counts)):
        p = check_int(p, f"prompt_lengths[{i}]")
        if not 0 <= p <= n:
            raise ValueError(f"sample {i}: prompt length {p} is outside [0, {n}] (the sample has {n} tokens)")
        if p > width:
            raise ValueError(f"sample {i}: prompt of {p} tokens is longer than prompt_width={width}")
        if n - p > response_width:
            raise ValueError(f"sample {i}: response of {n - p} tokens is longer than response_width={response_width}")
        out.append(p)
    return out


def aligned_counts(token_counts: Sequence[int], multiple: int) -> list[int]:
    """Each count rounded up to a multiple: the packed layout's per-sequence alignment.

    Examples:
        >>> aligned_counts([3, 4, 5], 4)
        [4, 4, 8]
    """
    return [-(-int(n) // multiple) * multiple for n in token_counts]


def default_max_output_bytes() -> int:
    """The default bound on one batch's output bytes: the machine's physical memory.

    `TORCH_R3_MAX_OUTPUT_BYTES` overrides it (an int of bytes).
    """
    env = os.environ.get(MAX_OUTPUT_BYTES_ENV)
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{MAX_OUTPUT_BYTES_ENV} must be an int of bytes, got {env!r}") from None
        if value < 1:
            raise ValueError(f"{MAX_OUTPUT_BYTES_ENV} must be >= 1, got {value}")
        return value
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: a bound no host batch reaches
        return 1 << 40


def output_size(needed: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[int, str]:
    """The bytes of tensors `{key: (shape, dtype)}`, and their shapes as text for messages."""
    total = sum(math.prod(shape) * dt.itemsize for shape, dt in needed.values())
    return total, ", ".join(f"{k} {list(shape)}" for k, (shape, _) in needed.items())


def check_output_size(needed: dict[str, tuple[tuple[int, ...], torch.dtype]], bound: int | None) -> None:
    """Refuse, before allocating, outputs larger than `bound` (`None`: `default_max_output_bytes()`).

    Args:
        needed: `{key: (shape, dtype)}` of the tensors about to be allocated.
        bound: the most bytes, or `None` for the default.

    Raises:
        ValueError: naming the size, the shapes and how to raise the bound.
    """
    total, shapes = output_size(needed)
    limit = default_max_output_bytes() if bound is None else bound
    if total > limit:
        raise ValueError(
            f"the batch would allocate {total} bytes ({total / 2**30:.1f} GiB: {shapes}), more than the bound of "
            f"{limit} bytes; check the token counts, seq_len and pad_to_multiple_of, or raise the bound with "
            f"memory=Memory(max_output_bytes=) (or {MAX_OUTPUT_BYTES_ENV})"
        )


def padded_length(token_counts: Sequence[int], pad_to_multiple_of: int | None = None) -> int:
    """`T` of the padded layout: the longest trajectory, rounded up to a multiple.

    Args:
        token_counts: the trajectories' token counts.
        pad_to_multiple_of: round up to a multiple of this, if given.

    Returns:
        The padded length `T`.

    Examples:
        >>> padded_length([3, 5], pad_to_multiple_of=4)
        8
    """
    longest = max(int(n) for n in token_counts)
    if pad_to_multiple_of is None:
        return longest
    multiple = check_positive(pad_to_multiple_of, "pad_to_multiple_of")
    return -(-longest // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
    """The global batch's geometry, computed from metadata (see `global_geometry`).

    Attributes:
        seq_len: `T` of the padded layout (the longest trajectory, rounded up).
        dtype: the route dtype of the batch (NumPy), as `collate_routes` would choose it.
        batch_size: `B`, the trajectories.
        num_tokens: the packed layout's token axis: `sum(n)`, or with
            `layout="packed"` and `pad_to_multiple_of` the sum of the aligned
            lengths (`cu_seqlens_padded[-1]`).
    """

    seq_len: int
    dtype: np.dtype
    batch_size: int
    num_tokens: int


def global_geometry(
    token_counts: Sequence[int],
    dtypes: Iterable[Any],
    *,
    layout: Padded | Packed | str = "padded",
    filler: str = "arange",
    num_experts: int | None = None,
    **deprecated: Any,
) -> BatchGeometry:
    """The global batch's `seq_len` and route dtype, from token counts and route dtypes alone.

    What `collate_routes` would choose for the whole batch, computed without
    any route bytes, so that every rank passes the same `seq_len=` and
    `dtype=` to its own collator and its micro-batches are slices of the
    global batch.

    Args:
        token_counts: every trajectory's token count `n_i` (positive ints).
        dtypes: the trajectories' route dtypes (NumPy or torch dtypes, or
            their names; any iterable, a set is enough).
        layout: the layout the batch is collated in: `torch_r3.Padded(
            pad_to_multiple_of=)` (`seq_len` rounded up to it) or
            `torch_r3.Packed(pad_to_multiple_of=)` (every sequence aligned, so
            that `num_tokens` is the aligned total; `seq_len` is then the
            longest aligned sequence, Transformer Engine's `max_seqlen`);
            `"padded"`/`"packed"` for the defaults. A `Padded` with `seq_len`
            is refused (this computes it), and so is a `PromptResponse` (its
            geometry is its two widths).
        filler: as in `collate_routes`; `balanced` widens the dtype where
            `num_experts - 1` does not fit it.
        num_experts: as in `collate_routes` (needed for `balanced`).
        **deprecated: `padding=` (`filler=`) and `pad_to_multiple_of=` (the
            layout's), each with a `DeprecationWarning`.

    Returns:
        A frozen `BatchGeometry` with `seq_len`, `dtype`, `batch_size`, `num_tokens`.

    Raises:
        TypeError: a count, dtype or setting of the wrong kind, naming it.
        ValueError: an empty batch, a non-positive count, a non-canonical dtype.

    Examples:
        >>> import numpy as np
        >>> from torch_r3 import Packed, Padded
        >>> geometry = global_geometry([3, 9, 5], [np.uint8, np.int16], layout=Padded(pad_to_multiple_of=4))
        >>> geometry.seq_len, geometry.dtype, geometry.num_tokens
        (12, dtype('int16'), 17)
        >>> global_geometry([3, 9, 5], [np.uint8], layout=Packed(pad_to_multiple_of=4)).num_tokens
        24
    """
    counts = check_token_counts(token_counts)
    if isinstance(dtypes, (str, bytes, np.dtype, torch.dtype, type)):
        dtypes = [dtypes]
    found = {check_route_dtype(d, f"dtypes[{k}]") for k, d in enumerate(dtypes)}
    if not found:
        raise ValueError("dtypes: expected at least one route dtype, got none")
    padding = deprecated.pop("padding", None)
    filler = renamed_argument(padding, filler, old="padding", new="filler", where="global_geometry", default="arange")
    value, _ = from_keywords(
        "global_geometry", layout, None, deprecated, keywords=("pad_to_multiple_of",), allowed=(Padded, Packed)
    )
    if isinstance(value, Padded) and value.seq_len is not None:
        raise ValueError(f"global_geometry computes seq_len: pass a Padded without it, got layout={value!r}")
    assert isinstance(value, (Padded, Packed))  # allowed= above
    multiple = value.pad_to_multiple_of
    num_experts = check_filler(filler, num_experts, 1)
    if num_experts is not None and filler == "balanced":
        found.add(canonical_dtype_for(num_experts - 1))
    return BatchGeometry(
        seq_len=padded_length(counts, multiple),
        dtype=widest(found),
        batch_size=len(counts),
        num_tokens=sum(counts if isinstance(value, Padded) or multiple is None else aligned_counts(counts, multiple)),
    )
