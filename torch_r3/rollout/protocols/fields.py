"""The field readers and checks every server protocol shares.

`torch_r3.rollout.protocols.base` says what a protocol provides; this module
holds what the protocols use to provide it: the readers of an answer's fields
(`get_field`, `first_choice`, `token_ids`, `logprob`, the log-prob blocks, the
finish reason, the weight-version spans) and the row-count check of the
routes (`slice_to_start`), each raising `WireFormatError` with the field's
path; and the two request-side rules every protocol keeps (`check_cache_salt`,
`params_with_start`).

This module needs NumPy only; it never imports aiohttp.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from torch_r3._checks import check_str
from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols._lists import TOKEN_ID_END, all_token_ids, entry_logprobs, plain_logprobs

# The call and span values are public (the client builds one, results carry the other); the
# readers serve the protocol modules.
__all__ = ["GenerateCall", "WeightVersionSpan", "check_cache_salt"]

log = logging.getLogger(__name__)

#: The sampling parameter that carries the route start in the torch_r3 and vLLM formats.
PROMPT_START_PARAM = "routed_experts_prompt_start"
#: vLLM 0.30+ refuses (HTTP 400) a `cache_salt` longer than this or holding one of `SALT_FORBIDDEN`.
MAX_SALT_CHARS = 128
SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


@dataclass(frozen=True)
class GenerateCall:
    """One generate call as the client checked it, before any protocol shapes it.

    Attributes:
        prompt: The prompt token ids.
        sampling_params: The caller's sampling parameters, passed on as they are.
        return_routed_experts: Whether routes were asked for.
        start: First position whose route is wanted (`0`: the whole prompt).
        cache_salt: The prefix-cache salt, a non-empty string, or `None`.
        model: The body's `model` field, or `None`.
        return_indexer_topk: Whether DSA indexer selections were asked for (SGLang only).
    """

    prompt: list[int]
    sampling_params: dict[str, Any]
    return_routed_experts: bool
    start: int = 0
    cache_salt: str | None = None
    model: str | None = None
    return_indexer_topk: bool = False


@dataclass(frozen=True)
class WeightVersionSpan:
    """The weight version that generated a run of a response's tokens.

    SGLang (0.5.19+, `meta_info.weight_versions`) and vLLM (0.32+,
    `choices[i].weight_versions`) report these spans over the generated tokens:
    a request that straddles a weight update has more than one.

    Attributes:
        version: The server's weight version.
        start: The first generated token of the span (0-based).
        end: The end of the span, as the server sent it (`start <= end <=`
            the number of generated tokens).
    """

    version: str
    start: int
    end: int


def check_cache_salt(salt: Any) -> str:
    """A cache salt every server accepts: a non-empty string of at most 128
    characters without `@`, `/`, `\\` or NUL (vLLM 0.30+ answers others with
    HTTP 400; one rule for every server keeps a salt portable).

    Raises:
        TypeError: `salt` is not a string.
        ValueError: It is empty, too long, or holds a forbidden character.

    Examples:
        >>> check_cache_salt("v12")
        'v12'
    """
    check_str(salt, "cache_salt")
    if not salt:
        raise ValueError(
            "cache_salt must be a non-empty string (servers refuse or ignore an empty salt); pass None for none"
        )
    if len(salt) > MAX_SALT_CHARS:
        raise ValueError(f"cache_salt has {len(salt)} characters; vLLM refuses more than {MAX_SALT_CHARS}")
    bad = [c for c in SALT_FORBIDDEN if c in salt]
    if bad:
        raise ValueError(
            f"cache_salt {salt!r:.60} holds {bad}; vLLM refuses '@', '/', '\\' and NUL in a salt "
            "(use e.g. 'ckpt-step_100' instead of 'ckpt/step_100')"
        )
    return salt


def get_field(container: Any, key: str, where: str, kind: type | tuple[type, ...], *, required: bool = True) -> Any:
    """`container[key]` checked to be of `kind` (`None` when absent and not required).

    Raises:
        WireFormatError: `container` is not an object, or the field is missing
            (when required) or of another type.
    """
    if type(container) is not dict and not isinstance(container, Mapping):  # a JSON object is a dict: no ABC check
        raise WireFormatError(f"{where}: expected a JSON object, got {type(container).__name__}")
    value = container.get(key)
    if value is None:
        if required:
            raise WireFormatError(f"{where}.{key} is missing")
        return None
    if type(value) is kind:  # the one type asked for, exactly (a bool is never an int here): no further test
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise WireFormatError(f"{where}.{key}: expected {_kind_name(kind)}, got {type(value).__name__}")
    return value


def first_choice(raw: Any) -> Mapping[str, Any]:
    """`raw["choices"][0]`, checked to be an object.

    Raises:
        WireFormatError: `raw` has no non-empty `choices` list of objects.
    """
    choices = get_field(raw, "choices", "response", list)
    if not choices:
        raise WireFormatError("response.choices is empty")
    if not isinstance(choices[0], Mapping):
        raise WireFormatError(f"choices[0]: expected a JSON object, got {type(choices[0]).__name__}")
    return choices[0]


def params_with_start(call: GenerateCall) -> dict[str, Any]:
    """A copy of `call.sampling_params` carrying the route start as `PROMPT_START_PARAM` (when past 0).

    Raises:
        ValueError: The caller put `PROMPT_START_PARAM` in the sampling parameters themselves.
    """
    params = dict(call.sampling_params)
    if PROMPT_START_PARAM in params:
        raise ValueError(
            f"pass {PROMPT_START_PARAM} as the keyword argument routed_experts_prompt_start, not inside sampling_params"
        )
    if call.return_routed_experts and call.start:
        params[PROMPT_START_PARAM] = call.start
    return params


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """A list of non-negative ints (not bools) as a tuple.

    Raises:
        WireFormatError: `value` is not such a list.
    """
    if not isinstance(value, list):
        raise WireFormatError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    if all_token_ids(value, TOKEN_ID_END):  # a few C-level passes; else the loop names the bad id
        return tuple(value)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < TOKEN_ID_END:
            raise WireFormatError(f"{where}[{i}]: expected an int token id in [0, 2**63), got {t!r:.40}")
    return tuple(value)


def logprob(value: Any, where: str, *, null_is_nan: bool = False) -> float:
    """A log-probability: a number `<= 0` (`-inf` included) as a float.

    Args:
        value: The wire value.
        where: The field, for messages.
        null_is_nan: Read `null` as NaN. SGLang writes both `-inf` and NaN as
            `null`, so which one it was is lost; NaN says "unknown".

    Raises:
        WireFormatError: `value` is not a number, is NaN, `+inf` or positive
            (no probability exceeds 1), or `null` where that is not allowed.
    """
    if value is None and null_is_nan:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value > 0:
        raise WireFormatError(f"{where}: expected a log-probability (<= 0), got {value!r:.40}")
    return float(value)


def completion_logprobs(choice: Mapping[str, Any], generated: int) -> tuple[float, ...] | None:
    """An OpenAI completions choice's `logprobs.token_logprobs`, one per generated token (`None` without a block).

    `null` is read as NaN: both engines that send this shape (vLLM, SGLang) write a
    `-inf` or NaN log-prob as `null`.

    Raises:
        WireFormatError: The block breaks the format or holds another number of entries.
    """
    block = get_field(choice, "logprobs", "choices[0]", dict, required=False)
    if block is None:
        return None
    values = get_field(block, "token_logprobs", "choices[0].logprobs", list)
    if len(values) != generated:
        raise WireFormatError(f"choices[0].logprobs.token_logprobs has {len(values)} entries for {generated} tokens")
    if (fast := plain_logprobs(values, null_is_nan=True)) is not None:  # a few C-level passes; else the loop
        return fast
    return tuple(logprob(v, f"choices[0].logprobs.token_logprobs[{i}]", null_is_nan=True) for i, v in enumerate(values))


def chat_logprobs(choice: Mapping[str, Any], generated: int, *, null_is_nan: bool) -> tuple[float, ...] | None:
    """An OpenAI chat choice's `logprobs.content[i].logprob`, one per generated token.

    `None` when the choice has no log-prob block or its `content` is `null`.

    Args:
        choice: The answer's first choice.
        generated: How many tokens it generated.
        null_is_nan: Read a `null` log-prob as NaN (SGLang writes `-inf` and NaN
            so); otherwise each entry's `logprob` must be a number.

    Raises:
        WireFormatError: The block breaks the format or holds another number of entries.
    """
    block = get_field(choice, "logprobs", "choices[0]", dict, required=False)
    if block is None or block.get("content") is None:
        return None
    content = get_field(block, "content", "choices[0].logprobs", list)
    if len(content) != generated:
        raise WireFormatError(f"choices[0].logprobs.content has {len(content)} entries for {generated} tokens")
    if (fast := entry_logprobs(content, None, null_is_nan=null_is_nan)) is not None:  # a few C passes; else the loop
        return fast
    values = []
    for i, entry in enumerate(content):
        where = f"choices[0].logprobs.content[{i}]"
        if not null_is_nan:
            value = get_field(entry, "logprob", where, (int, float))
        elif isinstance(entry, Mapping) and "logprob" in entry:
            value = entry["logprob"]
        else:
            raise WireFormatError(f"{where}: expected an object with a logprob, got {entry!r:.60}")
        values.append(logprob(value, f"{where}.logprob", null_is_nan=null_is_nan))
    return tuple(values)


def finish_reason(value: Any, where: str) -> str | None:
    """A finish reason normalised to a lower-case string (`None` stays `None`).

    SGLang sends an object `{"type": "stop" | "length" | "abort", ...}`; vLLM
    and the torch_r3 server send the string. Every protocol normalises to
    `"stop"`, `"length"` and `"abort"`; anything else is passed on lower-cased.

    Raises:
        WireFormatError: `value` is neither a string, an object with a string
            `type`, nor `null`.
    """
    if type(value) is dict or isinstance(value, Mapping):  # a JSON object is a dict: no ABC check
        value = value.get("type")
        where = f"{where}.type"
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise WireFormatError(f"{where}: expected a finish reason string, got {value!r}")
    return value.lower()


def weight_version(value: Any, where: str) -> str | None:
    """A weight version string, or `None` when the server sent none.

    Raises:
        WireFormatError: `value` is present but not a string.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise WireFormatError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    return value


def weight_spans(value: Any, where: str, generated: int) -> tuple[WeightVersionSpan, ...]:
    """The `weight_versions` spans of an answer (`()` when absent), checked.

    Raises:
        WireFormatError: Not a list of `{version: str, start: int, end: int}`
            objects with `0 <= start <= end <= generated`, in order.
    """
    if value is None:
        return ()
    if not isinstance(value, list):
        raise WireFormatError(f"{where}: expected a list of {{version, start, end}} spans, got {type(value).__name__}")
    spans: list[WeightVersionSpan] = []
    for i, item in enumerate(value):
        if _plain_span(item, spans[-1].end if spans else 0, generated):  # what the checks below accept
            spans.append(WeightVersionSpan(item["version"], item["start"], item["end"]))
            continue
        at = f"{where}[{i}]"
        version = get_field(item, "version", at, str)
        start, end = get_field(item, "start", at, int), get_field(item, "end", at, int)
        if not 0 <= start <= end:
            raise WireFormatError(f"{at}: expected 0 <= start <= end, got start={start}, end={end}")
        if end > generated:
            raise WireFormatError(f"{at}: end={end} is past the {generated} generated tokens")
        if spans and start < spans[-1].end:
            raise WireFormatError(f"{at}: spans must be in order without overlap; start={start} < {spans[-1].end}")
        spans.append(WeightVersionSpan(version, start, end))
    return tuple(spans)


def _plain_span(item: Any, after: int, generated: int) -> bool:
    """Whether `item` is a `{version: str, start: int, end: int}` object with `after <= start <= end <= generated`."""
    if type(item) is not dict:
        return False
    start, end = item.get("start"), item.get("end")
    return (
        type(item.get("version")) is str
        and type(start) is int
        and type(end) is int
        and after <= start <= end <= generated
    )


def newest_version(version: str | None, spans: tuple[WeightVersionSpan, ...]) -> str | None:
    """`version` when the server sent one, else the last span's (the newest), else `None`."""
    if version is not None:
        return version
    return spans[-1].version if spans else None


def expected_rows(prompt_len: int, generated: int, start: int) -> int:
    """Route rows that cover positions `[start, prompt_len + generated - 1)`.

    Examples:
        >>> expected_rows(5, 3, 0), expected_rows(5, 3, 2), expected_rows(4, 0, 4)
        (7, 5, 0)
    """
    return max(0, prompt_len + generated - 1 - start)


def slice_to_start(
    routes: np.ndarray,
    call: GenerateCall,
    generated: int,
    where: str,
    *,
    start_may_be_ignored: bool,
    start_field: str = PROMPT_START_PARAM,
) -> np.ndarray:
    """Check the row count of `routes` against the positions asked for.

    Args:
        routes: The decoded routes.
        call: The call they answer.
        generated: Tokens generated.
        where: The field, for messages.
        start_may_be_ignored: Accept an answer that covers every position from
            `0` although `call.start > 0` (a server that ignored the start
            field, e.g. sglang 0.5.10.post1), and drop the rows before the start
            (logged as a warning on this module's logger, naming `start_field`).
        start_field: The request field that carried the start, for that warning.

    Returns:
        The routes of positions `[call.start, P + O - 1)`; a copy when sliced,
        so the rows before the start are freed.

    Raises:
        WireFormatError: The row count fits neither.
    """
    rows = routes.shape[0]
    want = expected_rows(len(call.prompt), generated, call.start)
    if rows == want:
        return routes
    full = expected_rows(len(call.prompt), generated, 0)
    if start_may_be_ignored and call.start > 0 and rows == full:
        log.warning(
            "%s: the server ignored %s=%d and sent every row from 0 (an older server version?); "
            "keeping rows %d.. (the rows before were sent for nothing)",
            where,
            start_field,
            call.start,
            call.start,
        )
        return routes[call.start :].copy()
    raise WireFormatError(
        f"{where} has {rows} rows; positions {call.start} .. {len(call.prompt) + generated - 2} "
        f"({len(call.prompt)} prompt + {generated} generated tokens) need {want}"
    )
