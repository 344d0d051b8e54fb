"""`R3Collator`'s side of a batch: the samples' keys, per-token sequences and extra keys.

`batch_samples` checks a list of sample mappings once, before the kernel
writes anything, and splits each sample into its routes, its per-token
sequences (the tokens and the `pad_keys`, written by the kernel alongside the
routes) and its other keys (collated here by `default_collate`). Every refusal
names the sample and the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torch_r3.collate._extra_keys import FLOAT64_EXACT, numeric_dtypes, stack_numbers
from torch_r3.keys import INPUT_IDS, OUTPUT_KEYS

__all__ = ["SeqField", "batch_samples", "check_pad_number", "collate_extra", "prompt_lengths_of"]

# Token ids become torch.long: anything at or past 2**63 would wrap negative.
_INT64_END = 2**63


class SeqField:
    """A per-token sequence collated alongside the routes (`input_ids`, `loss_mask`, ...)."""

    __slots__ = ("key", "arrays", "pad", "dtype")

    def __init__(self, key: str, arrays: list[np.ndarray], pad: Any, dtype: torch.dtype):
        self.key, self.arrays, self.pad, self.dtype = key, arrays, pad, dtype


def _list_to_numpy(value: list | tuple, i: int, key: str, integer: bool) -> np.ndarray:
    """A Python list as NumPy makes it (ints -> int64, floats -> float64, like other float keys), checked."""
    if not value:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError, TypeError) as e:
        raise ValueError(f"sample {i}: {key!r} is not a flat list of numbers: {e}") from None
    if arr.dtype == object:  # an int beyond 64 bits, or mixed kinds
        raise ValueError(f"sample {i}: {key!r} holds values that fit no 64-bit dtype (an int >= 2**64 or < -2**63?)")
    if arr.dtype.kind == "f" and any(type(v) is int and abs(v) >= FLOAT64_EXACT for v in value):
        raise ValueError(
            f"sample {i}: {key!r} mixes ints beyond 2**53 with other values, which NumPy would round to float64"
            + ("; token ids must be < 2**63" if integer else "")
        )
    return arr


def _seq_to_numpy(value: Any, i: int, key: str, *, integer: bool) -> np.ndarray:
    """One sample's per-token sequence as a 1-D NumPy array (no copy for arrays and tensors)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise TypeError(f"sample {i}: {key!r} is a tensor on the meta device, which holds no values")
        try:
            arr = value.detach().cpu().numpy()
        except TypeError as e:  # bfloat16 and other dtypes NumPy lacks
            raise TypeError(f"sample {i}: {key!r} has dtype {value.dtype}, which NumPy cannot hold: {e}") from None
    elif isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        arr = _list_to_numpy(value, i, key, integer)
    else:
        raise TypeError(f"sample {i}: {key!r} must be a list, NumPy array or 1-D tensor, got {type(value).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"sample {i}: {key!r} must be 1-D, got shape {arr.shape}")
    if integer and arr.dtype.kind not in "iu":
        raise TypeError(f"sample {i}: {key!r} must hold integer token ids, got dtype {arr.dtype}")
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"sample {i}: {key!r} must be numeric, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= _INT64_END:
        raise ValueError(f"sample {i}: {key!r} holds {int(arr.max())}, which does not fit torch.long (must be < 2**63)")
    return arr


def _torch_dtype_of(arrays: list[np.ndarray], key: str) -> torch.dtype:
    dt = torch.from_numpy(np.empty(0, dtype=arrays[0].dtype)).dtype
    for i, a in enumerate(arrays[1:], start=1):
        this = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype
        try:
            dt = torch.promote_types(dt, this)
        except RuntimeError:  # torch does not promote its uint16/32/64 with other integer types
            raise ValueError(
                f"sample {i}: {key!r} is {a.dtype}, and sample 0 (or an earlier one) makes it {dt}: torch cannot "
                f"promote the two; give every sample's {key!r} the same dtype"
            ) from None
    return dt


def _check_list_kinds(samples: Sequence[Mapping[str, Any]], arrays: list[np.ndarray], key: str) -> None:
    """Python lists of one key must make one dtype: a mix would make the batch's dtype depend on its samples.

    Ints and floats promote to float64 in a batch that holds both and stay int64
    in one that holds only ints, so a micro-batch would differ from its rows of
    the global batch. Arrays and tensors carry their own dtype and are promoted.
    """
    first: tuple[int, np.dtype] | None = None
    for i, (s, a) in enumerate(zip(samples, arrays)):
        if not isinstance(s[key], (list, tuple)) or not len(s[key]):
            continue
        if first is None:
            first = (i, a.dtype)
        elif a.dtype != first[1]:
            raise ValueError(
                f"sample {i}: {key!r} is a list of {a.dtype.name} values and sample {first[0]}'s a list of "
                f"{first[1].name}: the batch's dtype would depend on which samples it holds (a micro-batch "
                f"of one kind would differ from the global batch); give every sample's {key!r} values of one "
                f"kind (floats: [float(v) for v in values]) or a NumPy array of one dtype"
            )


def check_pad_number(pad: Any, key: str) -> None:
    """A pad value must be a Python or NumPy number (or bool)."""
    if not isinstance(pad, (bool, int, float, np.bool_, np.integer, np.floating)):
        raise TypeError(f"pad value for {key!r} must be a number, got {type(pad).__name__}")


def _check_pad_value(pad: Any, dtype: torch.dtype, key: str) -> Any:
    """The pad value as a Python scalar that `dtype` holds exactly."""
    check_pad_number(pad, key)
    pad = pad.item() if isinstance(pad, (np.generic,)) else pad
    if dtype == torch.bool:
        if pad not in (0, 1):
            raise ValueError(f"pad value for {key!r} must be 0/1/False/True for a bool sequence, got {pad!r}")
        return bool(pad)
    if dtype.is_floating_point:
        pad = float(pad)
        if math.isfinite(pad) and abs(pad) > torch.finfo(dtype).max:
            raise ValueError(f"pad value {pad!r} for {key!r} does not fit {dtype} (it would become inf)")
        return pad
    if float(pad) != int(pad):
        raise ValueError(f"pad value {pad!r} for {key!r} is not representable in {dtype}")
    info = torch.iinfo(dtype)
    if not info.min <= int(pad) <= info.max:
        raise ValueError(f"pad value {pad!r} for {key!r} does not fit {dtype}")
    return int(pad)


def _key_hint(key: str, needed: tuple[str, ...], tokens_key: str, sample: Mapping[str, Any]) -> str:
    """How to name a missing key: the collator argument that sets it, and the keys the sample has."""
    keys = sorted(map(str, sample))[:12]
    if key == needed[0]:
        return f" (the routes); the sample has keys {keys}: name its routes' key with R3Collator(routes_key=...)"
    if key == tokens_key:
        return f" (the token ids); the sample has keys {keys}: name its tokens' key with R3Collator(tokens_key=...)"
    return f" (a pad_keys key); the sample has keys {keys}"


def _check_keys(samples: Any, needed: tuple[str, ...], tokens_key: str) -> None:
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise TypeError(f"expected a sequence of sample mappings, got {type(samples).__name__}")
    if len(samples) == 0:
        raise ValueError("expected at least one sample, got an empty batch")
    keys0 = None
    forbidden = OUTPUT_KEYS - set(needed)
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise TypeError(f"sample {i}: expected a mapping (dict), got {type(s).__name__}")
        for k in needed:
            if k not in s:
                raise ValueError(f"sample {i}: missing key {k!r}{_key_hint(k, needed, tokens_key, s)}")
        for k in forbidden:
            if k in s:
                what = "the tokens key's padded ids" if k == INPUT_IDS else "the collator's own"
                raise ValueError(
                    f"sample {i}: key {k!r} would be overwritten by {what} {k!r} in the batch; "
                    f"rename it in the dataset, or drop it from the samples if the collator's value "
                    f"serves (tokens key here: {tokens_key!r})"
                )
        keys = set(s)
        if keys0 is None:
            keys0 = keys
        elif keys != keys0:
            raise ValueError(f"sample {i}: keys differ from sample 0 in {sorted(keys ^ keys0, key=str)}")


def _layout_of(value: Any) -> Any:
    """What must agree between samples for `default_collate` to stack a key's values."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return ("array", tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return ("sequence", len(value))
    return ("scalar", type(value).__name__)


def _numeric_array(value: Any) -> np.ndarray | None:
    """A Python list or tuple of numbers as NumPy makes it, else None (strings, mixed objects)."""
    if not isinstance(value, (list, tuple)):
        return None
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged nesting
        return None
    return arr if arr.ndim >= 1 and arr.dtype.kind in "biuf" else None


def _extra_values(samples: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    """The samples' values of an extra key, a list or tuple of numbers made the array NumPy makes of it.

    One rule for every sequence of numbers, whatever holds it: a Python list and a NumPy
    array of the same numbers are collated alike (equal shapes stacked, different ones
    refused), as `default_collate` collates arrays. Only lists that are not all numbers
    (strings, mixed objects) stay one value per sample.
    """
    values = [s[key] for s in samples]
    arrays = [_numeric_array(v) for v in values]
    for i, (v, a) in enumerate(zip(values, arrays)):
        # A list of floats with an int beyond 2**53 in it: NumPy rounded the int (the scan runs only then).
        if a is not None and a.dtype.kind == "f" and a.size and np.abs(a).max() > FLOAT64_EXACT and _wide_int_in(v):
            raise ValueError(
                f"sample {i}: extra key {key!r} mixes ints beyond 2**53 with floats, which NumPy would round "
                f"to float64; give the ints alone, or a NumPy array of the dtype they need"
            )
    return [v if a is None else a for v, a in zip(values, arrays)]


def _wide_int_in(value: Any) -> bool:
    """A Python int beyond 2**53 anywhere in a (nested) list or tuple."""
    if isinstance(value, (list, tuple)):
        return any(_wide_int_in(v) for v in value)
    return type(value) is int and abs(value) > FLOAT64_EXACT


def _check_extra(samples: Sequence[Mapping[str, Any]], key: str) -> None:
    """Refuse, naming the sample, what `default_collate` would fail on without naming it."""
    values = _extra_values(samples, key)
    for i, v in enumerate(values):
        if v is None:
            raise TypeError(
                f"sample {i}: key {key!r} is None, which default_collate cannot batch; give it a value or drop the key"
            )
    if all(isinstance(v, (list, tuple)) for v in values):
        return  # lists that are not all numbers: returned as a list per sample, see collate_extra
    first = _layout_of(values[0])
    for i, v in enumerate(values[1:], start=1):
        if _layout_of(v) != first and first[0] != "scalar":
            raise ValueError(
                f"sample {i}: key {key!r} has shape/length {_layout_of(v)[1]}, sample 0 has {first[1]}; "
                f"default_collate needs equal sizes: list a per-token key in pad_keys, or drop it"
            )


def collate_extra(
    samples: Sequence[Mapping[str, Any]], keys: Sequence[str], dtypes: Mapping[str, np.dtype] | None = None
) -> dict[str, Any]:
    """`default_collate` of each extra key, its failures naming the key.

    A Python list or tuple of numbers is collated as the NumPy array NumPy makes of it
    (ints `int64`, floats `float64`), so lists and arrays follow one rule: equal shapes are
    stacked into a tensor `[B, ...]`, different shapes are refused (`_check_extra`; a
    per-token key belongs in `pad_keys`). A key whose values are all numbers, numeric
    arrays or tensors gets one dtype, NumPy's promotion of theirs, or the key's entry of
    `dtypes` (`torch_r3.collate._extra_keys`), the same in a DataLoader worker. A key whose
    values are lists that are not all numbers (strings, mixed objects) is returned as a list
    with each sample's own value: `default_collate` would transpose lists of equal length.

    Args:
        samples: the samples, already checked by `batch_samples`.
        keys: the extra keys `batch_samples` returned.
        dtypes: `R3Collator(extra_dtypes=)`: the global batch's dtype of some keys.

    Returns:
        `{key: collated value}`.
    """
    dtypes = dtypes or {}
    unknown = sorted(set(dtypes) - set(keys))
    if unknown:
        raise ValueError(
            f"extra_dtypes names {unknown[0]!r}, which the samples do not hold as an other key (theirs: {list(keys)})"
        )
    batch = {}
    for key in keys:
        values = _extra_values(samples, key)
        kinds = numeric_dtypes(values, key)
        if kinds is not None:
            values = stack_numbers(values, kinds, key, dtypes.get(key))
        elif key in dtypes:
            raise ValueError(f"extra_dtypes[{key!r}]: the samples' values of {key!r} are not all numbers or arrays")
        elif all(isinstance(v, (list, tuple)) for v in values):
            batch[key] = values
            continue
        try:
            batch[key] = torch.utils.data.default_collate(values)
        except (TypeError, ValueError, RuntimeError) as e:
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"key {key!r}: default_collate could not batch the samples' values: {e}"
            ) from e
    return batch


def batch_samples(
    samples: Sequence[Mapping[str, Any]],
    routes_key: str,
    tokens_key: str,
    pad_token_id: int,
    pad_keys: Mapping[str, Any],
) -> tuple[list[Any], list[SeqField], list[str]]:
    """Check samples and split them into their routes, per-token fields and extra keys.

    Args:
        samples: the DataLoader's list of sample mappings.
        routes_key: the key of each sample's routes.
        tokens_key: the key of each sample's token ids.
        pad_token_id: the pad value of the token ids.
        pad_keys: `{key: pad value}` of the other per-token keys.

    Returns:
        The per-sample routes (unchecked), the fields (tokens first) and the
        extra keys (checked, for `collate_extra`).
    """
    _check_keys(samples, (routes_key, tokens_key, *pad_keys), tokens_key)
    tokens = [_seq_to_numpy(s[tokens_key], i, tokens_key, integer=True) for i, s in enumerate(samples)]
    for i, t in enumerate(tokens):
        if t.shape[0] == 0:
            raise ValueError(f"sample {i}: {tokens_key!r} is empty; a trajectory needs at least one token")
    fields = [SeqField(INPUT_IDS, tokens, pad_token_id, torch.long)]
    for key, pad in pad_keys.items():
        arrs = [_seq_to_numpy(s[key], i, key, integer=False) for i, s in enumerate(samples)]
        _check_list_kinds(samples, arrs, key)
        for i, (a, t) in enumerate(zip(arrs, tokens)):
            if a.shape[0] != t.shape[0]:
                raise ValueError(f"sample {i}: {key!r} has {a.shape[0]} entries for {t.shape[0]} tokens")
        dt = _torch_dtype_of(arrs, key)
        fields.append(SeqField(key, arrs, _check_pad_value(pad, dt, key), dt))
    handled = {routes_key, tokens_key, *pad_keys}
    extra = [key for key in samples[0] if key not in handled]
    for key in extra:
        _check_extra(samples, key)
    return [s[routes_key] for s in samples], fields, extra


def prompt_lengths_of(samples: Sequence[Mapping[str, Any]], key: str) -> list[int]:
    """Each sample's prompt token count from its `key`: an int, or a one-element integer tensor or array.

    Only the type is checked here; the range (`0 <= p <= n`, within the
    widths) is the kernel's rule, checked with the token counts.
    """
    out = []
    for i, s in enumerate(samples):
        if key not in s:
            raise ValueError(f"sample {i}: missing key {key!r} (its prompt length, for layout='prompt_response')")
        value = s[key]
        if isinstance(value, (torch.Tensor, np.ndarray)):
            if isinstance(value, torch.Tensor):
                dt = value.dtype
                ok = not (dt.is_floating_point or dt.is_complex or dt == torch.bool) and value.device.type != "meta"
            else:
                ok = value.dtype.kind in ("i", "u")
            if not ok or math.prod(value.shape) != 1:
                raise TypeError(
                    f"sample {i}: {key!r} must be an int prompt length, got a {type(value).__name__} "
                    f"of dtype {value.dtype} and shape {list(value.shape)}"
                )
            value = value.item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"sample {i}: {key!r} must be an int prompt length, got {type(value).__name__}")
        out.append(int(value))
    return out
