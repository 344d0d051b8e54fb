"""Whole-list checks of a response's token ids and log-probs: a few C-level passes, no Python loop per item.

A protocol reads a list of values (token ids, log-probs, SGLang's
`[logprob, token_id, text]` triples) that a per-item loop checks one by one and
names the first bad item of. Each function here answers, in a few passes over
the whole list (`map(type, ...)`, `min`, `max`, `all`), whether every item
passes that same per-item check, and gives the values when they do. They are
exact where they say yes: a list they accept is one the per-item loop accepts,
with the same result. When they say no (`False` or `None`), the caller runs its
per-item loop, which raises its usual error naming the item, or accepts the
rare form checked here no faster (an `int` log-prob, say). So errors stay the
per-item loop's own, and a valid list costs a few passes instead of a call per item.
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any

__all__ = ["TOKEN_ID_END", "all_token_ids", "entry_logprobs", "plain_logprobs", "sglang_logprobs"]

#: Token ids travel as int64 (torch.long) from the protocols on: each is below this.
TOKEN_ID_END = 1 << 63

# `0.0 >= v`: true for every log-prob (`-inf` included), false for NaN, `+inf` and positives.
_AT_MOST_ZERO = (0.0).__ge__
_FLOAT = {float}
_FLOAT_OR_NULL = {float, type(None)}


def all_token_ids(values: list[Any], end: int) -> bool:
    """Whether every item is an `int` (not a `bool`) in `[0, end)`."""
    if not values:
        return True
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < end


def plain_logprobs(values: list[Any], *, null_is_nan: bool) -> tuple[float, ...] | None:
    """The log-probs of a list of floats `<= 0` (and `null`s read as NaN, when `null_is_nan`), else `None`."""
    types = set(map(type, values))
    if types <= _FLOAT:
        return tuple(values) if all(map(_AT_MOST_ZERO, values)) else None
    if not null_is_nan or not types <= _FLOAT_OR_NULL:
        return None
    numbers = [v for v in values if v is not None]
    if not all(map(_AT_MOST_ZERO, numbers)):
        return None
    return tuple(math.nan if v is None else v for v in values)


def sglang_logprobs(entries: list[Any], ids: tuple[int, ...]) -> tuple[float, ...] | None:
    """The log-probs of SGLang's `[logprob, token_id, ...]` entries whose ids are `ids`, else `None`."""
    if not entries or set(map(type, entries)) != {list} or min(map(len, entries)) < 2:
        return None
    return _matched(list(map(itemgetter(1), entries)), ids, list(map(itemgetter(0), entries)), null_is_nan=True)


def entry_logprobs(entries: list[Any], ids: tuple[int, ...] | None, *, null_is_nan: bool) -> tuple[float, ...] | None:
    """The `logprob` of each `{"logprob", "token_id"?}` object (its `token_id`s matching `ids`, when given), else `None`."""
    if not entries or set(map(type, entries)) != {dict}:
        return None
    try:
        values = list(map(itemgetter("logprob"), entries))
        tokens = None if ids is None else list(map(itemgetter("token_id"), entries))
    except KeyError:
        return None
    if tokens is None:
        return plain_logprobs(values, null_is_nan=null_is_nan)
    return _matched(tokens, ids, values, null_is_nan=null_is_nan)


def _matched(
    tokens: list[Any], ids: tuple[int, ...] | None, values: list[Any], *, null_is_nan: bool
) -> tuple[float, ...] | None:
    if set(map(type, tokens)) != {int} or tuple(tokens) != ids:
        return None
    return plain_logprobs(values, null_is_nan=null_is_nan)
