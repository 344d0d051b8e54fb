"""The collation kernel: per-trajectory route arrays -> one training batch.

`collate_routes` is the kernel; `R3Collator` wraps it as a `collate_fn` for
`torch.utils.data.DataLoader`. Both write the layouts described on the route
layout page of the documentation:

* `Padded`: `rollout_expert_indices [B, T, L, K]`, aligned like a left-
  (or, `Padded(side="right")`, right-) padded token batch;
  `router_padding_mask [B, T]` (`True` = no captured route); `attention_mask [B, T]`.
* `PromptResponse`: the same keys, `[B, P + R, ...]`, each prompt
  left-padded to `P` and each response right-padded to `R`.
* `Packed`: `rollout_expert_indices [sum(n), L, K]`, `router_padding_mask
  [sum(n)]` and `cu_seqlens [B + 1]` for THD training; with
  `pad_to_multiple_of`, each sequence aligned and `cu_seqlens_padded`.

The layout and memory values and their rules live in `torch_r3.collate.layout`, the
argument rules of the batch's geometry (`dtype`, `keep_layers`, `sample_ids`,
prompt lengths, the output-size bound) in `torch_r3.collate.geometry`, the samples' side of `R3Collator` in
`torch_r3.collate._samples`, the per-sample checks of the routes, token counts and
`out=` (all passed before the first byte is written) in
`torch_r3.collate._route_inputs`, the two writers in `torch_r3.collate._writers`. What remains
here is the kernel: the options, the allocation, and the hand-over to the
writers.

How it stays fast: the output is allocated uninitialised (or recycled, see
`torch_r3.BufferPool`) and every byte is written exactly once, row by row, by
the copy threads of `torch_r3.collate._pool`. Padding regions are copied from a small
cached padding template (one memcpy per chunk) instead of broadcasting a
`[L, K]` row element by element. NumPy releases the GIL for large copies, so
the threads really run in parallel, and they also share the first-touch page
faults of a fresh buffer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_bool, check_int
from torch_r3._deprecation import renamed_argument
from torch_r3.collate import _memory, _pool
from torch_r3.collate._buffers import BufferPool
from torch_r3.collate._extra_keys import check_extra_dtypes
from torch_r3.collate._filler import FillerWriter, check_filler, padding_rows
from torch_r3.collate._route_inputs import check_aliasing, check_batch, check_out, output_dtype
from torch_r3.collate._samples import SeqField, batch_samples, check_pad_number, collate_extra, prompt_lengths_of
from torch_r3.collate._writers import packed_writer, padded_writer
from torch_r3.collate.geometry import (
    aligned_counts,
    check_layers,
    check_layers_in_range,
    check_output_size,
    check_prompt_lengths,
    check_route_dtype,
    check_sample_ids,
    output_size,
    packed_offsets,
    padded_length,
)
from torch_r3.collate.layout import (
    LAYOUT_KEYWORDS,
    MEMORY_KEYWORDS,
    Layout,
    Memory,
    Packed,
    Padded,
    PromptResponse,
    from_keywords,
)
from torch_r3.keys import (
    ATTENTION_MASK,
    CU_SEQLENS,
    CU_SEQLENS_PADDED,
    INPUT_IDS,
    OUTPUT_KEYS,
    ROUTER_MASK,
    ROUTES,
    SAMPLE_ROUTES,
)

__all__ = ["R3Collator", "collate_routes", "padding_rows"]

MAX_WORKERS = _pool.MAX_WORKERS

_NP_TO_TORCH = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
}


# --------------------------------------------------------------------------
# Options and validation (everything is checked before any byte is written)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Options:
    """The settings `collate_routes` and `R3Collator` share, validated once (the layout and memory by their values)."""

    layout: Layout = dataclasses.field(default_factory=Padded)
    memory: Memory = dataclasses.field(default_factory=Memory)
    filler: str = "arange"
    num_experts: int | None = None
    dtype: Any = None
    keep_layers: Any = None
    compact: bool = False

    def __post_init__(self) -> None:
        if self.dtype is not None:
            object.__setattr__(self, "dtype", check_route_dtype(self.dtype))
        if self.keep_layers is not None:
            object.__setattr__(self, "keep_layers", check_layers(self.keep_layers, "keep_layers"))
        object.__setattr__(self, "compact", check_bool(self.compact, "compact"))
        object.__setattr__(self, "num_experts", check_filler(self.filler, self.num_experts, 1))


def _row_copier(layers: tuple[int, ...] | None) -> Callable[[np.ndarray, np.ndarray], None]:
    """`copy(dst, src)` writing `src`'s selected layers into `dst`, each byte of `dst` once."""
    if layers is None:
        return lambda dst, src: np.copyto(dst, src, casting="safe")
    step = layers[1] - layers[0] if len(layers) > 1 else 1
    if step != 0 and all(b - a == step for a, b in itertools.pairwise(layers)):
        stop = layers[-1] + step
        sel = slice(layers[0], None if stop < 0 else stop, step)  # a view: one strided copy
        return lambda dst, src: np.copyto(dst, src[:, sel], casting="safe")

    index = np.asarray(layers, dtype=np.intp)

    def copy_each(dst: np.ndarray, src: np.ndarray) -> None:
        if src.dtype == dst.dtype:
            # Straight into dst: the indices were range-checked, and mode="clip"
            # skips the buffered copy that mode="raise" makes.
            np.take(src, index, axis=1, out=dst, mode="clip")
            return
        for k, layer in enumerate(layers):  # widening: one strided copy per layer
            np.copyto(dst[:, k], src[:, layer], casting="safe")

    return copy_each


def _collate(
    arrays: Sequence[np.ndarray],
    counts: list[int],
    opts: _Options,
    *,
    out: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    buffers: BufferPool | None = None,
    fields: Sequence[SeqField] = (),
    sample_ids: Any = None,
    prompt_lengths: Any = None,
) -> dict[str, torch.Tensor]:
    B, (_, num_layers, topk) = len(arrays), arrays[0].shape
    check_filler(opts.filler, opts.num_experts, topk)
    ids = list(range(B)) if sample_ids is None else check_sample_ids(sample_ids, B)
    if opts.keep_layers is not None:
        check_layers_in_range(opts.keep_layers, num_layers)
    dtype = output_dtype(arrays, topk, filler=opts.filler, num_experts=opts.num_experts, dtype=opts.dtype)
    out_layers = num_layers if opts.keep_layers is None else len(opts.keep_layers)
    row_shape, tdtype = (out_layers, topk), _NP_TO_TORCH[dtype]
    layout, memory = opts.layout, opts.memory
    if isinstance(layout, PromptResponse):
        prompts = check_prompt_lengths(prompt_lengths, counts, layout.prompt_width, layout.response_width)
        T = layout.width
        starts = [layout.prompt_width - p for p in prompts]
    elif prompt_lengths is not None:
        raise ValueError(f"prompt_lengths applies to torch_r3.PromptResponse only, got layout={layout!r}")
    elif isinstance(layout, Padded):
        if layout.seq_len is None:
            T = padded_length(counts, layout.pad_to_multiple_of)
        else:
            T = layout.seq_len
            for i, n in enumerate(counts):
                if n > T:
                    raise ValueError(f"sample {i} has {n} tokens, more than seq_len={T}")
        starts = [T - n for n in counts] if layout.side == "left" else [0] * B
    if not isinstance(layout, Packed):
        want = {
            ROUTES: ((B, T) + row_shape, tdtype),
            ROUTER_MASK: ((B, T), torch.bool),
            ATTENTION_MASK: ((B, T), torch.long),
        }
        want.update({f.key: ((B, T), f.dtype) for f in fields})
    else:
        spans = counts if layout.pad_to_multiple_of is None else aligned_counts(counts, layout.pad_to_multiple_of)
        offsets = packed_offsets(spans)
        N = int(offsets[-1])
        want = {
            ROUTES: ((N,) + row_shape, tdtype),
            ROUTER_MASK: ((N,), torch.bool),
            CU_SEQLENS: ((B + 1,), torch.int32),
        }
        if layout.pad_to_multiple_of is not None:
            want[CU_SEQLENS_PADDED] = ((B + 1,), torch.int32)
        want.update({f.key: ((N,), f.dtype) for f in fields})

    result = check_out(out, want)
    check_aliasing(result, arrays, fields)
    kind = _memory.memory_kind(memory.pin_memory)
    needed = {k: spec for k, spec in want.items() if k not in result}
    check_output_size(needed, memory.max_output_bytes)
    try:
        if buffers is not None and kind != "shared":  # never recycled in a worker: see BufferPool
            result.update(buffers.empty_batch(needed, pinned=kind == "pinned"))
        else:
            result.update({k: _memory.empty(shape, dt, kind) for k, (shape, dt) in needed.items()})
    except (OSError, RuntimeError, MemoryError) as e:  # mmap's ENOMEM, torch's allocator, NumPy
        total, shapes = output_size(needed)
        raise MemoryError(f"could not allocate {total} bytes of {kind} memory for the batch ({shapes}): {e}") from e
    result = {k: result[k] for k in want}  # the layout's key order, whoever supplied each
    views = {k: v.numpy() for k, v in result.items()}
    fill_pad = FillerWriter(opts.filler, opts.num_experts, out_layers, topk, dtype)
    copy_rows = _row_copier(opts.keep_layers)
    if not isinstance(layout, Packed):
        costs, write_rows = padded_writer(views, arrays, counts, starts, ids, fill_pad, copy_rows, fields)
    else:
        views[CU_SEQLENS][0] = 0
        views[CU_SEQLENS][1:] = np.cumsum(counts)  # the real lengths, whether aligned or not
        if layout.pad_to_multiple_of is not None:
            views[CU_SEQLENS_PADDED][:] = offsets
        costs, write_rows = packed_writer(views, arrays, counts, offsets, ids, fill_pad, copy_rows, fields)
    workers = _pool.default_workers() if memory.workers is None else memory.workers
    _pool.run(costs, write_rows, workers, views[ROUTES].nbytes)
    return result


def _options(
    where: str,
    layout: Any,
    memory: Any,
    deprecated: dict[str, Any],
    filler: str,
    num_experts: Any,
    dtype: Any,
    keep_layers: Any,
    compact: Any,
    keywords: tuple[str, ...] = LAYOUT_KEYWORDS + MEMORY_KEYWORDS,
) -> _Options:
    """The options of one collator, the deprecated keywords folded in (each warned, on the user's line)."""
    padding, layers = deprecated.pop("padding", None), deprecated.pop("layers", None)
    filler = renamed_argument(padding, filler, old="padding", new="filler", where=where, default="arange")
    keep_layers = renamed_argument(layers, keep_layers, old="layers", new="keep_layers", where=where)
    layout, memory = from_keywords(where, layout, memory, deprecated, keywords=keywords)
    return _Options(layout, memory, filler, num_experts, dtype, keep_layers, compact)  # the fields' order


def collate_routes(
    routes: Sequence[Any],
    token_counts: Sequence[int],
    *,
    layout: Layout | str = "padded",
    prompt_lengths: Sequence[int] | None = None,
    filler: str = "arange",
    num_experts: int | None = None,
    dtype: Any = None,
    keep_layers: Sequence[int] | None = None,
    sample_ids: Sequence[int] | None = None,
    out: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    memory: Memory | None = None,
    compact: bool = False,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """Collate per-trajectory route arrays into one training batch.

    Args:
        routes: one array `[r_i, L, K]` per trajectory, of a canonical dtype
            (`uint8`/`int16`/`int32`; CPU tensors of those dtypes too).
            Read-only and non-contiguous arrays are fine. A mixed batch promotes
            to the widest dtype, by dtype alone (and further if a padding
            expert id would not fit it).
        token_counts: `n_i`, the trajectory's token count, `n_i >= r_i`.
            Captured rows are a prefix of the tokens; the tail is padding.
        layout: the batch's layout, a value: `torch_r3.Padded(side=,
            pad_to_multiple_of=, seq_len=)` (`[B, T, L, K]`), `torch_r3.Packed(
            pad_to_multiple_of=)` (`[sum(n), L, K]` with `cu_seqlens`) or
            `torch_r3.PromptResponse(prompt_width, response_width)` (`[B, P + R,
            L, K]`); `"padded"`/`"packed"` mean `Padded()`/`Packed()`.
        prompt_lengths: each sample's prompt token count `p_i`
            (`PromptResponse` only, `0 <= p_i <= n_i`, `p_i <= P`,
            `n_i - p_i <= R`): its first `p_i` tokens are the prompt.
        filler: the routes written where no route was captured: `"arange"`
            (experts `0..K-1`), `"balanced"` (position `s = g + p` uses
            `(s*K + j) % num_experts`, for the sample's global row `g` and the
            position `p` from its first token, so a subset gets the global
            batch's filler; needs `num_experts >= K`) or `"zeros"` (every id 0, for trainers that mask those rows
            themselves; a zero row is no valid route for `K > 1`, so it must
            never be replayed through Megatron's dropless dispatcher, which
            needs `K` distinct experts).
        num_experts: the model's expert count: when given, every expert id
            is checked against it (a `ValueError` naming the sample, row,
            layer and bound; one min and max scan per sample); `balanced`
            needs it. Without it the routes' values are trusted (the dtype
            bounds them). Repeated experts in a route are not looked for here:
            `compact_routes` refuses them on the sender, and the replay hooks
            on the training device.
        out: caller-owned buffers to write into: a tensor for
            `rollout_expert_indices` or a dict with some of the output keys,
            each of exactly the output's shape and dtype.
        dtype: the output's route dtype (`uint8`, `int16` or `int32`, NumPy
            or torch). Narrower samples widen; a wider sample is refused,
            never narrowed.
        keep_layers: indices into the routes' layer axis to keep (distinct,
            in range): the output holds only those layers, in that order (a
            pipeline stage's layers). Still one write per output byte.
        sample_ids: each sample's row in the global batch (distinct ints
            `>= 0`; default `0 .. B-1`). `balanced` padding is keyed by it, so
            that a subset gets exactly the global batch's padding routes.
        memory: a `torch_r3.Memory`: copy threads (`workers`), pinning
            (`pin_memory`), a `BufferPool` to take the outputs from (`buffers`,
            for keys not in `out`; by default every call allocates fresh
            memory) and the output-size bound (`max_output_bytes`).
            `cache_bytes` is `R3Collator`'s and refused here.
        compact: compact non-canonical routes (int64 arrays, nested lists,
            as a Hugging Face dataset returns them) with `compact_routes` at
            collation, one scan and copy per such sample; off by default,
            since the sender compacting once is cheaper.
        **deprecated: the old keywords, each with a `DeprecationWarning`:
            `padding=` (`filler=`), `layers=` (`keep_layers=`), the layout's
            (`padding_side=`, `prompt_width=`, `response_width=`,
            `pad_to_multiple_of=`, `seq_len=`) and the memory's (`workers=`,
            `pin_memory=`, `buffers=`, `max_output_bytes=`).

    Returns:
        The batch: `rollout_expert_indices`, `router_padding_mask` and, padded or prompt/response,
        `attention_mask`; packed, `cu_seqlens` (and `cu_seqlens_padded` with `pad_to_multiple_of`).

    Raises:
        TypeError: an argument of the wrong kind, naming it (and the sample).
        ValueError: a wrong shape, dtype, count or setting, naming the sample.

    Examples:
        >>> import numpy as np, torch
        >>> a = np.array([[[5, 6]], [[7, 8]]], dtype=np.uint8)   # 2 rows, 1 layer, top-2
        >>> b = np.array([[[9, 1]]], dtype=np.uint8)             # 1 row
        >>> batch = collate_routes([a, b], [2, 3])
        >>> routes = batch["rollout_expert_indices"]
        >>> routes[:, :, 0].tolist()
        [[[0, 1], [5, 6], [7, 8]], [[9, 1], [0, 1], [0, 1]]]
        >>> batch["router_padding_mask"].tolist()
        [[True, False, False], [False, True, True]]
        >>> batch["attention_mask"].tolist()
        [[0, 1, 1], [1, 1, 1]]
    """
    opts = _options(
        "collate_routes",
        layout,
        memory,
        deprecated,
        filler,
        num_experts,
        dtype,
        keep_layers,
        compact,
        keywords=(
            *("padding_side", "prompt_width", "response_width", "pad_to_multiple_of", "seq_len"),
            *("workers", "pin_memory", "buffers", "max_output_bytes"),
        ),
    )
    if opts.memory.cache_bytes is not None:
        raise ValueError(
            "collate_routes: Memory.cache_bytes bounds R3Collator's own pool; here pass memory=Memory(buffers=pool) "
            "with a torch_r3.BufferPool(cache_bytes=...)"
        )
    arrays, counts = check_batch(routes, token_counts, compact=opts.compact, num_experts=opts.num_experts)
    return _collate(
        arrays, counts, opts, out=out, buffers=opts.memory.buffers, sample_ids=sample_ids, prompt_lengths=prompt_lengths
    )


class R3Collator:
    """`collate_fn` for `torch.utils.data.DataLoader` batches of R3 samples.

    A sample is a mapping with the trajectory's routes (`routes_key`, an array
    `[r_i, L, K]` of a canonical dtype) and its tokens (`tokens_key`, a list,
    NumPy array or 1-D tensor of token ids). The batch holds `input_ids`
    (left-padded with `pad_token_id`), `attention_mask`,
    `rollout_expert_indices` and `router_padding_mask` (packed: `input_ids`
    `[sum(n)]`, `cu_seqlens`, no attention mask). Keys in `pad_keys`
    (per-token sequences as long as the tokens, e.g. `loss_mask`) are padded
    the same way with their pad value; every other key is collated by
    `torch.utils.data.default_collate`, a Python list of numbers exactly as
    the NumPy array of the same numbers: equal shapes are stacked into a
    tensor `[B, ...]`, different shapes are refused naming the sample (a
    per-token key belongs in `pad_keys`). A key of numbers, numeric arrays
    or tensors gets NumPy's promotion of the samples' values (`np.result_type`:
    a Python int `int64`, a float `float64`, so `[0, 0.1]` is `float64`), in the
    main process and in DataLoader workers alike, or its `extra_dtypes` entry;
    64-bit ints beyond 2**53 that would become `float64` are refused.
    Only lists that are not all numbers (strings) come back as a list per
    sample. A sample may not carry a key the collator computes
    (`attention_mask` from a tokenizer, for instance).

    Outputs are recycled: each collator owns a `BufferPool`, and a batch's
    memory is reused once no tensor, view or NumPy array of it is alive. Inside
    a DataLoader worker the batch goes to fresh shared memory instead (the main
    process may still hold the previous batch, which the worker cannot see).

    Picklable (spawn-started workers get an empty pool), safe after `fork` and
    safe to call from several threads.

    Args:
        routes_key: the samples' key for their routes.
        tokens_key: the samples' key for their token ids.
        layout: the batch's layout, one value: `torch_r3.Padded(side=,
            pad_to_multiple_of=, seq_len=)`, `torch_r3.Packed(pad_to_multiple_of=)`
            or `torch_r3.PromptResponse(prompt_width, response_width,
            prompt_length_key=)` (`"padded"`/`"packed"` mean the defaults), as in
            `collate_routes`; `seq_len` is also the length of `input_ids` and
            the `pad_keys`, and `prompt_length_key` is the samples' key holding
            their prompt token count (an int; the key stays in the batch).
        pad_token_id: the token id of padding (fits `int64`), required: pass
            the tokenizer's (`tokenizer.pad_token_id`), as
            `transformers.DataCollatorWithPadding` takes it from the tokenizer.
            No id is right for every vocabulary (0 is a real token in most), so
            none is assumed.
        pad_keys: per-token keys to pad alongside the tokens: `{key: pad value}`,
            or a sequence of keys padded with 0.
        filler: as in `collate_routes`.
        num_experts: as in `collate_routes`.
        dtype: as in `collate_routes`.
        keep_layers: as in `collate_routes`.
        compact: as in `collate_routes`.
        memory: a `torch_r3.Memory`, as in `collate_routes`, and its
            `cache_bytes`: the most bytes of idle output buffers this
            collator's own pool keeps (`None`: twice the largest batch served,
            `0`: fresh memory every batch); with `buffers=` the given pool's
            own bound applies instead.
        extra_dtypes: `{key: dtype}` (torch or NumPy) for other keys: the
            global batch's dtype of a key, for a subset of it (a micro-batch,
            whose own values may promote narrower); each value must cast to
            it exactly, and the samples must hold the key.
        **deprecated: the old keywords, each with a `DeprecationWarning`
            naming its new spelling: `padding=`, `layers=`, the layout's
            (`padding_side=`, `prompt_width=`, `response_width=`,
            `prompt_length_key=`, `pad_to_multiple_of=`, `seq_len=`) and the
            memory's (`workers=`, `pin_memory=`, `cache_bytes=`, `buffers=`,
            `max_output_bytes=`).

    Calling it: `collator(samples)` or `collator(samples, sample_ids=ids)`
    with the samples' rows in the global batch (see `collate_routes`).

    Raises:
        TypeError: a setting of the wrong kind, naming it.
        ValueError: a setting out of range, naming it.

    Examples:
        >>> import numpy as np
        >>> from torch.utils.data import DataLoader
        >>> samples = [
        ...     {"input_ids": [11, 12, 13], "routes": np.zeros((2, 4, 2), np.uint8), "reward": 1.0},
        ...     {"input_ids": [21], "routes": np.zeros((0, 4, 2), np.uint8), "reward": 0.0},
        ... ]
        >>> loader = DataLoader(samples, batch_size=2, collate_fn=R3Collator(pad_token_id=0))
        >>> batch = next(iter(loader))
        >>> batch["input_ids"].tolist(), batch["rollout_expert_indices"].shape
        ([[11, 12, 13], [0, 0, 21]], torch.Size([2, 3, 4, 2]))
        >>> batch["router_padding_mask"].tolist(), batch["reward"].tolist()
        ([[False, False, True], [True, True, True]], [1.0, 0.0])
    """

    def __init__(
        self,
        *,
        routes_key: str = SAMPLE_ROUTES,
        tokens_key: str = INPUT_IDS,
        layout: Layout | str = "padded",
        pad_token_id: int,
        pad_keys: Mapping[str, float] | Sequence[str] = (),
        filler: str = "arange",
        num_experts: int | None = None,
        dtype: Any = None,
        keep_layers: Sequence[int] | None = None,
        compact: bool = False,
        memory: Memory | None = None,
        extra_dtypes: Mapping[str, Any] | None = None,
        **deprecated: Any,
    ) -> None:
        self._options = _options(
            "R3Collator", layout, memory, deprecated, filler, num_experts, dtype, keep_layers, compact
        )
        if pad_token_id is None:
            raise TypeError(
                "pad_token_id=None: the tokenizer has no pad token; set one (tokenizer.pad_token = "
                "tokenizer.eos_token is common) or pass the id input_ids are padded with"
            )
        self.pad_token_id = check_int(pad_token_id, "pad_token_id")
        if not -(2**63) <= self.pad_token_id < 2**63:
            raise ValueError(f"pad_token_id must fit int64 (input_ids are torch.long), got {self.pad_token_id}")
        if isinstance(pad_keys, str):
            raise TypeError("pad_keys must be a mapping {key: pad value} or a sequence of keys, not a str")
        self.pad_keys = dict(pad_keys) if isinstance(pad_keys, Mapping) else {k: 0 for k in pad_keys}
        for key, pad in self.pad_keys.items():
            check_pad_number(pad, key)
        clash = ({routes_key, tokens_key} | OUTPUT_KEYS) & set(self.pad_keys)
        if clash:
            raise ValueError(f"pad_keys may not include the routes/tokens/output keys {sorted(clash)}")
        self.routes_key = routes_key
        self.tokens_key = tokens_key
        reserved = {routes_key, tokens_key} | OUTPUT_KEYS | set(self.pad_keys)
        self.extra_dtypes = check_extra_dtypes(extra_dtypes, reserved)
        memory = self._options.memory
        # The collator's own pool, bounded by cache_bytes, unless the memory names a shared one.
        self.buffers = memory.buffers if memory.buffers is not None else BufferPool(memory.cache_bytes)

    @property
    def layout(self) -> Layout:
        """The batch's layout value."""
        return self._options.layout

    @property
    def memory(self) -> Memory:
        """The memory options."""
        return self._options.memory

    def __repr__(self) -> str:
        o = self._options
        options = "".join(
            f", {name}={value!r}"
            for name, value in (("dtype", o.dtype), ("keep_layers", o.keep_layers))
            if value is not None
        )
        return (
            f"R3Collator(layout={o.layout!r}, routes_key={self.routes_key!r}, tokens_key={self.tokens_key!r}, "
            f"pad_keys={self.pad_keys!r}, filler={o.filler!r}{options}, "
            f"cache_bytes={self.buffers.cache_bytes!r})"
        )

    def __call__(self, samples: Sequence[Mapping[str, Any]], sample_ids: Sequence[int] | None = None) -> dict[str, Any]:
        routes, fields, extra = batch_samples(
            samples, self.routes_key, self.tokens_key, self.pad_token_id, self.pad_keys
        )
        try:
            counts = [tokens.shape[0] for tokens in fields[0].arrays]
            opts = self._options
            arrays, counts = check_batch(routes, counts, compact=opts.compact, num_experts=opts.num_experts)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} [key {self.routes_key!r}]") from None
        prompts = None
        if isinstance(opts.layout, PromptResponse):
            prompts = prompt_lengths_of(samples, opts.layout.prompt_length_key)
        extra_batch = collate_extra(samples, extra, self.extra_dtypes)
        batch: dict[str, Any] = _collate(
            arrays,
            counts,
            self._options,
            buffers=self.buffers,
            fields=fields,
            sample_ids=sample_ids,
            prompt_lengths=prompts,
        )
        batch.update(extra_batch)
        return batch
