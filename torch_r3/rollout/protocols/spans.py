"""Route text read in place: a response body parsed as JSON, its route strings left as views.

A route payload is nearly all of an answer (81 MB of an 81 MB SGLang body for
32k tokens of a DeepSeek-V3-shaped model), and `json.loads` would copy it into
a Python `str` before a decoder reads it once. `parse_body` instead finds
each route string by its key, parses everything else as JSON, and puts a
read-only `memoryview` of the string's bytes in the body where the string
would have been. The codec's decoders read that view like any base64 text,
so a protocol's `parse_response` does not change.

Where the route strings sit is a small spec, the protocol's
`route_text_paths`: tuples of keys, with `"*"` for every item of a list,
e.g. `("meta_info", "routed_experts")` for SGLang's `/generate` or
`("choices", "*", "routed_experts")` for vLLM. A new response shape plugs in by
listing its paths; nothing here changes.

Why the result is the body's own JSON: each candidate is the string that
follows `"<last key of a path>":`, up to the next quote, with no backslash in
it and nothing but printable ASCII (a string with escapes is left to
`json.loads`, and so is one with a byte below 0x20, which `json.loads`
refuses with its own message and position, or one from 0x80, whose UTF-8
`json.loads` checks). It is replaced by a placeholder string holding a
random per-process token and a bare `@`, and the rest is
parsed. A candidate that was not a string value (say the key sat inside
another string) makes that text invalid JSON, since the `@` lands outside a
string; and a placeholder that parses but is not found at one of the paths
means the key sat somewhere else: there it gets its text back, as a `str`.
For the first case, and for a body that is not valid JSON at all, the whole
body goes to `json.loads`, which gives the same value or the same error as
before. So the result equals `json.loads(body)`
with each route string at a path replaced by a view of its bytes, which are
its text (base64 has no character JSON escapes), and every view holds ASCII
only, so a decoder reads it exactly as it reads the `str`: the same result,
the same error.

A body under `SMALL_BODY_BYTES` (16 KiB) is `json.loads(body)` itself: there
the fixed cost of locating the strings is more than copying them, and since
a view holds exactly the text of the `str` it replaces, every decoder gives
the same result, or the same error, for either.

Memory: the views are not copies; the rest, with placeholders, is one copy
of the non-route bytes, and its parsed objects.

Every `json.loads` named here is `torch_r3.rollout._json.loads`: the same
value or the same error, read by orjson where it is installed and can give
exactly that value.

This module needs the standard library and NumPy (for the printable-ASCII
check: one vectorised minimum per route string); it never imports aiohttp.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np

from torch_r3.rollout import _json

# The body parser and its spec serve the transport and the protocols.
__all__ = ["parse_body", "route_text_bytes"]

#: At most this many route strings are read in place per body (more are parsed as JSON).
MAX_SPANS = 64
#: The piece of a route string scanned at once: it stays in a core's L2 cache across the three scans.
SCAN_BYTES = 256 << 10
#: A body shorter than this is parsed by `json.loads` whole: copying its little route text into
#: a `str` costs less than locating it, and a decoder reads the `str` as it reads the view.
SMALL_BODY_BYTES = 16 << 10
_KEY = re.compile(r"[A-Za-z0-9_]+")
_WHITESPACE = rb"[ \t\n\r]*"  # JSON's four
# The placeholders' prefix: random per process, and never sent, so no body can forge one.
_MARKER = f"@torch_r3-route-{secrets.token_hex(8)}-"


def _candidates(body: bytearray | bytes, pattern: re.Pattern[bytes]) -> Iterator[tuple[int, int]]:
    """`(first, end)` of the text of each string that follows `"key":` for one of the pattern's keys."""
    at = 0
    while True:
        match = pattern.search(body, at)
        if match is None:
            return
        first = match.end()
        end, plain = _string_end(body, first)
        if end < 0:
            return  # unterminated: json.loads names the error
        at = end + 1
        if plain:
            yield first, end


def _string_end(body: bytearray | bytes, first: int) -> tuple[int, bool]:
    """The next quote from `first` (`-1`: none), and whether the text before it has no backslash and is printable ASCII.

    The base64 text is skipped by memchr, never scanned by the regex. The three scans
    (the quote, a backslash, the minimum) go a cache-sized piece at a time, so a body
    fresh from the socket is read from memory once, not three times.
    """
    plain = True
    at = first
    while at < len(body):
        stop = min(at + SCAN_BYTES, len(body))
        end = body.find(b'"', at, stop)
        upto = stop if end < 0 else end
        if plain and (body.find(b"\\", at, upto) >= 0 or not _is_plain_ascii(body, at, upto)):
            plain = False
        if end >= 0:
            return end, plain
        at = stop
    return -1, plain


def _is_plain_ascii(body: bytearray | bytes, first: int, end: int) -> bool:
    """Whether `body[first:end]` is printable ASCII: no byte below 0x20 (JSON refuses it raw in a
    string) and none from 0x80 (not ASCII, so left to `json.loads`, which checks the UTF-8).

    Read as `int8`, the bytes from 0x80 are negative: one vectorised minimum over a view finds
    both (about as fast as the memchr for a backslash; a regex or `bytes.translate` would be
    50-200 times slower).
    """
    if end == first:
        return True
    return int(np.frombuffer(body, dtype=np.int8, count=end - first, offset=first).min()) >= 0x20


@functools.lru_cache(maxsize=64)
def _locator(paths: tuple[tuple[str, ...], ...]) -> re.Pattern[bytes] | None:
    """The pattern that finds `"key":` + the opening quote for the last keys of `paths` (`None`: no paths)."""
    keys = sorted({path[-1] for path in paths})
    for key in keys:
        if not _KEY.fullmatch(key):
            raise ValueError(f"route text paths must end in a plain key, got {key!r}")
    if not keys:
        return None
    alternatives = b"|".join(re.escape(key.encode("ascii")) for key in keys)
    return re.compile(b'"(?:' + alternatives + b')"' + _WHITESPACE + b":" + _WHITESPACE + b'"')


def parse_body(body: bytearray | bytes, paths: tuple[tuple[str, ...], ...]) -> Any:
    """`json.loads(body)`, with each route string at one of `paths` left as a view of the body.

    Args:
        body: The response body (UTF-8 JSON).
        paths: Where route strings sit: tuples of keys, `"*"` for every list
            item. Each path's last key is a plain name (letters, digits, `_`).

    Returns:
        The parsed JSON; where a path leads to a route string, a read-only
        `memoryview` of its bytes in `body` instead of a `str` (in a body of
        at least `SMALL_BODY_BYTES`; a smaller one is `json.loads(body)`).

    Raises:
        ValueError: `body` is not valid JSON (`json.JSONDecodeError`, or a
            `UnicodeDecodeError`), exactly as `json.loads` raises it.
        RecursionError: The JSON is nested too deeply for `json.loads`.

    Examples:
        >>> paths = (("meta_info", "routed_experts"),)
        >>> parse_body(b'{"meta_info": {"routed_experts": "AAAA"}}', paths)  # small: json.loads itself
        {'meta_info': {'routed_experts': 'AAAA'}}
        >>> text = "A" * SMALL_BODY_BYTES
        >>> tree = parse_body(('{"meta_info": {"routed_experts": "' + text + '"}}').encode(), paths)
        >>> view = tree["meta_info"]["routed_experts"]
        >>> type(view).__name__, bytes(view) == text.encode()
        ('memoryview', True)
    """
    pattern = _locator(paths)
    if len(body) < SMALL_BODY_BYTES:
        return _json.loads(body)
    spans = []
    for span in _candidates(body, pattern) if pattern is not None else ():
        spans.append(span)
        if len(spans) == MAX_SPANS:
            break
    if not spans:
        return _json.loads(body)
    marker = _MARKER
    view = memoryview(body).toreadonly()
    pieces: list[bytes | memoryview] = []
    at = 0
    for i, (first, end) in enumerate(spans):
        pieces += [view[at:first], f"{marker}{i}".encode("ascii")]
        at = end
    pieces.append(view[at:])
    try:
        tree = _json.loads(b"".join(pieces))
    except ValueError:
        return _json.loads(body)  # not a string value, or not JSON at all: the body's own answer
    views = [view[first:end] for first, end in spans]
    if _place(tree, paths, marker, views) != len(spans):
        _restore(tree, marker, views)  # a key sat elsewhere too: there, the text it held
    return tree


def _place(tree: Any, paths: tuple[tuple[str, ...], ...], marker: str, views: list[memoryview]) -> int:
    """Put each view where its placeholder parsed, along `paths`; the number placed."""
    placed = 0
    for path in paths:
        for parent, key in _leaves(tree, path):
            value = parent[key]
            if isinstance(value, str) and value.startswith(marker):
                index = value[len(marker) :]
                if index.isdigit() and int(index) < len(views):
                    parent[key] = views[int(index)]
                    placed += 1
    return placed


def _restore(tree: Any, marker: str, views: list[memoryview]) -> None:
    """Put back the text of every placeholder not at a path (a walk of the parsed rest, not of the body)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in list(items):
            if isinstance(value, str) and value.startswith(marker):
                node[key] = str(views[int(value[len(marker) :])], "ascii")
            elif isinstance(value, (dict, list)):
                stack.append(value)


def _leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[Any, Any]]:
    """`(container, key)` of every value `path` reaches in `node`."""
    key, rest = path[0], path[1:]
    items: list[tuple[Any, Any]] = []
    if key == "*":
        items = list(enumerate(node)) if isinstance(node, list) else []
    elif isinstance(node, dict) and key in node:
        items = [(key, node[key])]
    for k, child in items:
        if rest:
            yield from _leaves(child, rest)
        else:
            yield node, k


def route_text_bytes(tree: Any, paths: tuple[tuple[str, ...], ...]) -> int:
    """The length of the route text `paths` reach in a parsed body (views and strings alike).

    Examples:
        >>> route_text_bytes({"choices": [{"routed_experts": "AAAA"}, {}]}, (("choices", "*", "routed_experts"),))
        4
    """
    total = 0
    for path in paths:
        for parent, key in _leaves(tree, path):
            value = parent[key]
            if isinstance(value, (str, bytes, memoryview)):
                total += len(value)
    return total
