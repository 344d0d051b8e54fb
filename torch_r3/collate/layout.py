"""A batch's layout and its memory options, each one value: `Padded`, `Packed`, `PromptResponse`, `Memory`.

Every collator of the package (`R3Collator`, `collate_routes`, `ShardCollator`,
`collate_selections`, the SkyRL and verl integrations, `global_geometry`) takes
the same `layout=` value, and those that allocate take the same `memory=`:

* `Padded(side="left", pad_to_multiple_of=None, seq_len=None)`: `[B, T, ...]`,
  padded on `side`, `T` the longest sample rounded up to `pad_to_multiple_of`,
  or exactly `seq_len`;
* `Packed(pad_to_multiple_of=None)`: `[sum(n), ...]` with `cu_seqlens`, each
  sequence aligned on its own with `pad_to_multiple_of` (`cu_seqlens_padded`);
* `PromptResponse(prompt_width, response_width, prompt_length_key="prompt_length")`:
  `[B, P + R, ...]`, each prompt left-padded to `P`, each response right-padded to `R`;
* `Memory(workers=None, pin_memory=None, cache_bytes=None, buffers=None, max_output_bytes=None)`:
  where and how the output is written, never what it holds.

Each value is checked once, where it is built, so a layout option cannot be
given to a layout it does not belong to. The strings `"padded"` and `"packed"`
mean `Padded()` and `Packed()`. The old keyword arguments (`padding_side=`,
`seq_len=`, `workers=`, ...) keep working through `from_keywords` with a
`DeprecationWarning` naming the new spelling.

This module's old content, the batch geometry (`BatchLayout`, `global_layout`,
`padded_length`), lives in `torch_r3.collate.geometry`; the old names still resolve here
and warn.

Examples:
    >>> from torch_r3 import Memory, Packed, Padded, PromptResponse
    >>> Padded(side="right", pad_to_multiple_of=8)
    Padded(side='right', pad_to_multiple_of=8, seq_len=None)
    >>> PromptResponse(prompt_width=4, response_width=6).width
    10
    >>> Packed(pad_to_multiple_of=0)
    Traceback (most recent call last):
        ...
    ValueError: Packed.pad_to_multiple_of must be >= 1, got 0
    >>> Memory(workers=1, pin_memory=False)
    Memory(workers=1, pin_memory=False, cache_bytes=None, buffers=None, max_output_bytes=None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeAlias

from torch_r3._checks import check_bool, check_choice, check_non_negative, check_positive, check_str
from torch_r3._deprecation import RENAMED_KEYWORDS, at_old_default, renamed_name, warn_old_default, warn_renamed
from torch_r3.collate import _memory, _pool
from torch_r3.collate._buffers import BufferPool
from torch_r3.keys import PROMPT_LENGTH

__all__ = ["Layout", "Memory", "Packed", "Padded", "PromptResponse"]

#: Where the padded layout's padding goes.
PADDING_SIDES = ("left", "right")


def check_padding_side(side: Any, name: str = "side") -> str:
    """The padded layout's side: `"left"` (real tokens end at `T`) or `"right"` (they start at 0)."""
    return check_choice(side, name, PADDING_SIDES)


#: The longest padded length: a tensor dimension (int64).
MAX_PADDED_LENGTH = 2**63 - 1
#: The largest packed alignment: the packed batch's offsets (`cu_seqlens`, `cu_seqlens_padded`) are int32.
MAX_PACKED_LENGTH = 2**31 - 1


def _length(value: Any, name: str, maximum: int, why: str) -> int:
    """A positive int at most `maximum`, refused naming `name` and `why` the bound holds."""
    out = check_positive(value, name)
    if out > maximum:
        raise ValueError(f"{name} must be <= {maximum} ({why}), got {out}")
    return out


def check_seq_len(seq_len: Any, name: str = "seq_len") -> int:
    """A fixed batch length `T`: a positive int, a tensor dimension."""
    return _length(seq_len, name, MAX_PADDED_LENGTH, "a tensor dimension")


def check_max_output_bytes(value: Any, name: str = "max_output_bytes") -> int | None:
    """The output-size bound: `None` (the default bound, `torch_r3.collate.geometry`) or a positive int."""
    return None if value is None else check_positive(value, name)


def _multiple(value: Any, name: str, maximum: int, why: str) -> int | None:
    return None if value is None else _length(value, name, maximum, why)


@dataclasses.dataclass(frozen=True)
class Padded:
    """The padded layout: `[B, T, ...]`, every sample padded to `T` on one side.

    Args:
        side: `"left"` (the real tokens end at `T`, as a generation batch is
            padded) or `"right"` (they start at 0).
        pad_to_multiple_of: round `T`, the longest sample, up to a multiple
            (at most `2**63 - 1`, as `seq_len`: a tensor dimension).
        seq_len: pad to exactly this `T` (a multiple of `pad_to_multiple_of`
            when both are given); a sample with more tokens is refused. Give the
            global batch's `T` (`torch_r3.global_geometry`) to collate a subset
            of it.

    Raises:
        TypeError: an option of the wrong kind, naming it.
        ValueError: an option out of range, naming it.
    """

    side: str = "left"
    pad_to_multiple_of: int | None = None
    seq_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "side", check_padding_side(self.side, "Padded.side"))
        multiple = _multiple(
            self.pad_to_multiple_of, "Padded.pad_to_multiple_of", MAX_PADDED_LENGTH, "a tensor dimension"
        )
        object.__setattr__(self, "pad_to_multiple_of", multiple)
        if self.seq_len is not None:
            seq_len = check_seq_len(self.seq_len, "Padded.seq_len")
            if multiple is not None and seq_len % multiple:
                raise ValueError(f"Padded.seq_len={seq_len} is not a multiple of pad_to_multiple_of={multiple}")
            object.__setattr__(self, "seq_len", seq_len)


@dataclasses.dataclass(frozen=True)
class Packed:
    """The packed (THD) layout: `[sum(n), ...]` with `cu_seqlens [B + 1]`, no padding between samples.

    Args:
        pad_to_multiple_of: pad each sequence on its own to a multiple
            (Transformer Engine's THD and context parallelism need it), adding
            `cu_seqlens_padded` (the aligned offsets; `cu_seqlens` stays the
            real lengths' sums); at most `2**31 - 1`, as the int32 offsets.

    Raises:
        TypeError: an option of the wrong kind, naming it.
        ValueError: an option out of range, naming it.
    """

    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        multiple = _multiple(
            self.pad_to_multiple_of, "Packed.pad_to_multiple_of", MAX_PACKED_LENGTH, "the offsets are int32"
        )
        object.__setattr__(self, "pad_to_multiple_of", multiple)


@dataclasses.dataclass(frozen=True)
class PromptResponse:
    """The prompt/response layout: `[B, P + R, ...]`, each prompt left-padded to `P`, each response right-padded to `R`.

    Args:
        prompt_width: `P`, the prompts' width.
        response_width: `R`, the responses' width.
        prompt_length_key: `R3Collator`'s key of each sample's prompt token
            count (its first that many tokens are its prompt); the key stays in
            the batch. `collate_routes` takes the counts as `prompt_lengths=`.

    Raises:
        TypeError: an option of the wrong kind, naming it.
        ValueError: a width below 1.
    """

    prompt_width: int
    response_width: int
    prompt_length_key: str = PROMPT_LENGTH

    def __post_init__(self) -> None:
        for name in ("prompt_width", "response_width"):
            width = _length(getattr(self, name), f"PromptResponse.{name}", MAX_PADDED_LENGTH, "a tensor dimension")
            object.__setattr__(self, name, width)
        check_str(self.prompt_length_key, "PromptResponse.prompt_length_key")

    @property
    def width(self) -> int:
        """`P + R`, the batch's length."""
        return self.prompt_width + self.response_width


Layout: TypeAlias = Padded | Packed | PromptResponse
"""Any layout value."""

LAYOUT_TYPES = (Padded, Packed, PromptResponse)
_NAMES = {"padded": Padded, "packed": Packed}


@dataclasses.dataclass(frozen=True)
class Memory:
    """Where and how a batch's outputs are written: never what they hold.

    Args:
        workers: copy threads, at most `torch_r3.cpu.MAX_WORKERS`; default
            `torch_r3.cpu.pool_workers()` (in a DataLoader worker, its share of
            the usable CPUs). `1` runs on the calling thread.
        pin_memory: `None` pins when an accelerator exists and the call is in
            the main process; `True`/`False` force it (never an error on a
            CPU-only machine). Inside a DataLoader worker the output goes to
            fresh shared memory instead.
        cache_bytes: `R3Collator` only: the most bytes of idle output buffers
            its own pool keeps for reuse; `None` for the default bound (twice
            the largest batch served), `0` to allocate fresh memory every batch.
        buffers: a `torch_r3.BufferPool` to take the outputs from (shared by
            several collators, say); then the pool's own bound applies, and
            `cache_bytes` is refused. `collate_routes` allocates fresh memory
            without one.
        max_output_bytes: refuse, before allocating, a batch whose outputs
            would take more bytes; default the physical memory, or
            `TORCH_R3_MAX_OUTPUT_BYTES`.

    Raises:
        TypeError: an option of the wrong kind, naming it.
        ValueError: an option out of range, or `buffers` with `cache_bytes`.
    """

    workers: int | None = None
    pin_memory: bool | None = None
    cache_bytes: int | None = None
    buffers: BufferPool | None = None
    max_output_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.workers is not None:
            object.__setattr__(self, "workers", _pool.check_workers(self.workers))
        object.__setattr__(self, "pin_memory", _memory.check_pin_memory(self.pin_memory))
        if self.cache_bytes is not None:
            object.__setattr__(self, "cache_bytes", check_non_negative(self.cache_bytes, "cache_bytes"))
        if self.buffers is not None:
            if not isinstance(self.buffers, BufferPool):
                raise TypeError(f"buffers must be None or a torch_r3.BufferPool, got {type(self.buffers).__name__}")
            if self.cache_bytes is not None:
                raise ValueError("pass buffers= or cache_bytes=, not both: a given BufferPool keeps its own bound")
        object.__setattr__(self, "max_output_bytes", check_max_output_bytes(self.max_output_bytes))

    def with_defaults(self, **fields: Any) -> Memory:
        """This memory with each of `fields` set where it is `None` (an integration's own defaults).

        Examples:
            >>> Memory(workers=2).with_defaults(pin_memory=False, workers=4)
            Memory(workers=2, pin_memory=False, cache_bytes=None, buffers=None, max_output_bytes=None)
        """
        return dataclasses.replace(self, **{k: v for k, v in fields.items() if getattr(self, k) is None})


#: The old keyword arguments of a layout and of the memory options (`RENAMED_KEYWORDS`' entries for them).
LAYOUT_KEYWORDS = tuple(k for k, v in RENAMED_KEYWORDS.items() if v.new == "layout" and v.field is not None)
MEMORY_KEYWORDS = tuple(k for k, v in RENAMED_KEYWORDS.items() if v.new == "memory")


def _layout_of(name: Any, where: str, allowed: tuple[type, ...]) -> type:
    """The layout class an old `layout=` string meant."""
    cls = (
        {"padded": Padded, "packed": Packed, "prompt_response": PromptResponse}.get(name)
        if isinstance(name, str)
        else None
    )
    if cls is None:
        check_layout(name, where, allowed)  # the error for a string that names no layout
        raise AssertionError(name)  # pragma: no cover - check_layout raised
    return cls


def _check_fields(cls: type, fields: Mapping[str, Any], where: str, layout: Any) -> None:
    """Refuse an old keyword whose field the layout class `cls` lacks, naming the layouts that have it."""
    wanted = {f.name for f in dataclasses.fields(cls)}
    for field in fields:
        if field not in wanted:
            old = next(k for k in LAYOUT_KEYWORDS if RENAMED_KEYWORDS[k].field == field)
            raise ValueError(f"{where}: {old}= applies to {_owners(field)} only, got layout={layout!r}")


def _owners(field: str) -> str:
    return " and ".join(
        f"torch_r3.{cls.__name__}" for cls in LAYOUT_TYPES if field in {f.name for f in dataclasses.fields(cls)}
    )


def _spelled(cls: type, fields: Mapping[str, Any]) -> str:
    return f"torch_r3.{cls.__name__}(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def check_layout(layout: Any, where: str, allowed: tuple[type, ...] = LAYOUT_TYPES) -> Layout:
    """A `layout=` argument as its value: a layout value of `allowed`, or `"padded"`/`"packed"` for the defaults."""
    if isinstance(layout, str):
        cls = _NAMES.get(layout)
        if cls is None:
            if layout == "prompt_response" and PromptResponse in allowed:
                raise ValueError(
                    f"{where}: layout='prompt_response' needs its widths: pass "
                    f"layout=torch_r3.PromptResponse(prompt_width=P, response_width=R)"
                )
            if layout in PADDING_SIDES and Padded in allowed:
                raise ValueError(
                    f"{where}: layout={layout!r} names a padding side, not a layout: pass "
                    f"layout=torch_r3.Padded(side={layout!r})"
                )
            check_choice(layout, "layout", tuple(_NAMES))  # the enum rule's wording, for a string naming no layout
            raise AssertionError(layout)  # pragma: no cover - check_choice raised
        layout = cls()
    if not isinstance(layout, allowed):
        names = " or ".join(f"torch_r3.{cls.__name__}" for cls in allowed)
        strings = " or ".join(repr(name) for name, cls in _NAMES.items() if cls in allowed)
        got = type(layout).__name__ if isinstance(layout, LAYOUT_TYPES) else repr(layout)
        raise (ValueError if isinstance(layout, LAYOUT_TYPES) else TypeError)(
            f"{where}: layout must be {names} (or {strings}), got {got:.80}"
        )
    return layout  # type: ignore[return-value]  # one of LAYOUT_TYPES, checked above


def from_keywords(
    where: str,
    layout: Any,
    memory: Any,
    old: dict[str, Any],
    *,
    keywords: tuple[str, ...],
    allowed: tuple[type, ...] = LAYOUT_TYPES,
    default: Layout | None = None,
) -> tuple[Layout, Memory]:
    """`layout=` and `memory=` as values, folding in the old keyword arguments `old`: the one place they are read.

    `old` holds the keywords the caller passed that are not parameters any
    more (it is emptied). Each of `keywords`, the old keywords `where` really
    took (`torch_r3._deprecation.RENAMED_KEYWORDS`), warns on the user's line
    and means what it meant; any other keyword is a `TypeError`, as Python
    gives for an unknown keyword. One passed at its old default value warns and
    changes nothing. An old keyword next to a layout (or memory) value is
    refused: the value already says it. `default` is `where`'s own default
    layout value, which the old keywords refine (SkyRL's right-padded
    micro-batch); a string `layout=` is refined into its class.

    Raises:
        TypeError: an unknown keyword, a layout or memory of the wrong kind, or
            an old keyword next to a value that holds it.
        ValueError: a layout option the layout does not have, or a bad option.
    """
    unknown = next((k for k in old if k not in keywords), None)
    if unknown is not None:
        raise TypeError(f"{where} got an unexpected keyword argument {unknown!r}")
    given = {}
    for k, v in old.items():
        if at_old_default(k, v):
            warn_old_default(where, k, v)
        else:
            given[k] = v
    old.clear()
    layout_old = {k: v for k, v in given.items() if RENAMED_KEYWORDS[k].new == "layout"}
    memory_old = {k: v for k, v in given.items() if RENAMED_KEYWORDS[k].new == "memory"}
    if layout_old:
        layout = _fold_layout(where, layout, layout_old, allowed, default)
    return check_layout(layout, where, allowed), _fold_memory(where, memory, memory_old)


def _fold_layout(where: str, layout: Any, old: dict[str, Any], allowed: tuple[type, ...], default: Any) -> Layout:
    """The layout value the old layout keywords `old` (none at its old default) spell, each warned."""
    if not isinstance(layout, str) and (default is None or layout is not default):
        raise TypeError(
            f"{where}: pass {', '.join(f'{k}=' for k in old)} inside layout= only (deprecated keywords "
            f"of the layout value), not both"
        )
    fields: dict[str, Any] = {}
    for k, v in old.items():
        field = RENAMED_KEYWORDS[k].field
        if field is not None:  # `packed=` picks the class, below
            fields[field] = v
    if "packed" in old:  # SkyRL's microbatch(packed=True): the packed layout
        base = Packed() if check_bool(old["packed"], "packed") else default
    elif isinstance(layout, str):
        base = _layout_of(layout, where, allowed)
    else:
        base = layout
    cls = base if isinstance(base, type) else type(base)
    _check_fields(cls, fields, where, layout)
    if cls is PromptResponse and not {"prompt_width", "response_width"} <= set(fields):
        raise ValueError(
            f"{where}: layout='prompt_response' needs prompt_width= and response_width=: pass "
            f"layout=torch_r3.PromptResponse(prompt_width=P, response_width=R)"
        )
    value = cls(**fields) if isinstance(base, type) else dataclasses.replace(base, **fields)
    for k, v in old.items():
        field = RENAMED_KEYWORDS[k].field
        warn_renamed(f"{where}({k}=)", f"layout={_spelled(cls, {} if field is None else {field: v})}")
    return value


def _fold_memory(where: str, memory: Any, old: dict[str, Any]) -> Memory:
    """The memory value `memory=` and the old memory keywords `old` (none at its old default) spell, each warned."""
    if memory is None:
        memory = Memory()
    elif not isinstance(memory, Memory):
        raise TypeError(f"{where}: memory must be a torch_r3.Memory, got {type(memory).__name__}")
    if not old:
        return memory
    if memory != Memory():
        raise TypeError(
            f"{where}: pass {', '.join(f'{k}=' for k in old)} inside memory= only (deprecated keywords "
            f"of the memory value), not both"
        )
    for k, v in old.items():
        shown = repr(v) if v is None or isinstance(v, (bool, int)) else "..."
        warn_renamed(f"{where}({k}=)", f"memory=torch_r3.Memory({k}={shown})")
    return Memory(**old)


def __getattr__(name: str) -> Any:
    # The module's old content: the batch geometry, renamed and moved to torch_r3.collate.geometry
    # (`import torch_r3.collate.layout` runs torch_r3/__init__.py first, which imports it).
    return renamed_name(__name__, name)
