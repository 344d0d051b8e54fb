"""The HTTP transport under `RemoteGenerateClient`: sessions, retries, caps.

One job: send a request to the inference server and hand back the parsed JSON
of a `2xx` answer, or raise `RemoteGenerateError` naming the URL. The protocol
(what the body holds, how the answer is read) lives in `torch_r3.rollout.protocols`.

What is retried, with exponential backoff and jitter:

- a connection that could not be established (the server never saw the
  request, so re-sending is always safe);
- a connection that broke after the request was sent (server disconnect, reset,
  a body cut off mid-transfer) and a timeout: the server may already be running
  the generation, or have finished it, so a retry can make it run twice;
- `429 Too Many Requests` (the server refused the request; safe to re-send) and
  `502`, `503`, `504` (a gateway or an overloaded server; behind a gateway the
  upstream may have started). A `Retry-After` header on these statuses sets the
  delay, capped at `max_backoff`.

Never retried: any other status, a body over `max_response_bytes`, or a body
that is not JSON. A redirect (`3xx`) is never followed: it is an error naming
the URL and its `Location` (re-sending a POST elsewhere would carry its body
and custom headers there). The JSON is parsed here with a nesting guard, and
the body is read in chunks into a buffer that grows with the bytes received
(never from a declared `Content-Length`) under the cap, so a hostile server
can neither exhaust memory nor raise anything but `RemoteGenerateError`.

Each retry is logged as a warning on the `torch_r3.rollout.transport` logger (silent
unless the application configures logging).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from torch_r3._checks import check_finite_float, check_non_negative, check_positive
from torch_r3.errors import RemoteGenerateError

# `HttpTransport` and its defaults serve `RemoteGenerateClient`, which owns one;
# users configure it through `TransportConfig`.
__all__ = ["TransportConfig"]

# 1 GiB: a 128k-token SGLang capture of a 61-layer top-8 model is 256 MiB of
# int32, 341 MiB as base64; four times that still fits.
DEFAULT_MAX_RESPONSE_BYTES = 1 << 30
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
log = logging.getLogger(__name__)
# An error body is read only this far: enough for the server's message.
ERROR_BODY_BYTES = 64 << 10
READ_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class TransportConfig:
    """Retries, backoff, timeouts, concurrency and the body cap of a client.

    Attributes:
        retries: Retries after the first attempt (`0`: try once).
        backoff: Base delay in seconds; retry `n` (from 1) waits
            `min(max_backoff, backoff * 2**(n-1))` scaled by a random factor in
            `[0.5, 1.0]` (jitter, so restarted servers are not hit in lockstep).
        max_backoff: Cap on one delay, in seconds, a `Retry-After` included
            (a larger `Retry-After` waits `max_backoff`, then retries). Must
            be finite: `inf` would let one header park a call for years.
        timeout: Seconds one attempt may take in total (connect, send, generate,
            read); `None` for no limit (not `inf`). Generation can be slow: keep it generous.
        connect_timeout: Seconds to establish a connection; `None` for no
            separate limit.
        max_concurrency: Requests in flight at once per event loop (also the
            connection pool size of the client's own sessions).
        max_response_bytes: The most bytes one response body may have; a larger
            body is refused while it is read (from its `Content-Length` when
            declared). Route payloads are capped at three quarters of it (what
            base64 text of that size can decode to).
        headers: Extra headers sent with every request (e.g. authorization);
            left out of the `repr`.
        session: Your own `aiohttp.ClientSession`, used on the event loop it
            belongs to and never closed by the client (which then cannot be pickled).
        ssl: Passed to the `aiohttp.TCPConnector` of the client's own sessions
            (an `ssl.SSLContext`, or `False` to skip verification).
        trace_configs: `aiohttp.TraceConfig`s for the client's own sessions.

    Raises:
        TypeError: A value of the wrong kind (`headers` not a mapping of
            strings, `session` not an `aiohttp.ClientSession`).
        ValueError: A value out of range, or `session` together with
            `ssl`/`trace_configs` (set those on your session).
    """

    retries: int = 5
    backoff: float = 0.5
    max_backoff: float = 10.0
    timeout: float | None = 600.0
    connect_timeout: float | None = 30.0
    max_concurrency: int = 64
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    headers: Mapping[str, str] | None = field(default=None, repr=False, hash=False)
    session: aiohttp.ClientSession | None = field(default=None, repr=False, hash=False)
    ssl: Any = field(default=True, hash=False)
    trace_configs: Sequence[aiohttp.TraceConfig] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        self._check_connection()
        # Frozen: the checked values (NumPy scalars become int/float) are set through object.__setattr__.
        checked: dict[str, Any] = {
            "retries": check_non_negative(self.retries, "retries"),
            "max_concurrency": check_positive(self.max_concurrency, "max_concurrency"),
            "max_response_bytes": check_positive(self.max_response_bytes, "max_response_bytes"),
        }
        # Finite: max_backoff=inf would let one Retry-After park a call for years.
        for name in ("backoff", "max_backoff"):
            checked[name] = check_finite_float(getattr(self, name), name)
        for name in ("timeout", "connect_timeout"):
            value = getattr(self, name)
            if value is not None:
                checked[name] = check_finite_float(value, name, allow_zero=False, note="None for no limit")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def _check_connection(self) -> None:
        if self.headers is not None:
            if not isinstance(self.headers, Mapping):
                raise TypeError(f"headers must be a mapping of strings, got {type(self.headers).__name__}")
            for key, value in self.headers.items():
                if not isinstance(key, str) or not isinstance(value, str):
                    raise TypeError(f"headers[{key!r}] must map a string to a string, got {type(value).__name__}")
            object.__setattr__(self, "headers", dict(self.headers))  # a copy: later edits of yours do not leak in
        if self.trace_configs is not None:
            object.__setattr__(self, "trace_configs", tuple(self.trace_configs))
        if self.session is not None:
            if not isinstance(self.session, aiohttp.ClientSession):
                raise TypeError(f"session must be an aiohttp.ClientSession, got {type(self.session).__name__}")
            if self.ssl is not True or self.trace_configs is not None:
                raise ValueError(
                    "ssl and trace_configs configure the client's own sessions; set them on your session instead"
                )

    @property
    def max_route_bytes(self) -> int:
        """The cap on one decoded route payload: what a body of `max_response_bytes` base64 can hold."""
        return self.max_response_bytes // 4 * 3

    def delay(self, retry: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry number `retry` (1-based).

        Args:
            retry: The retry about to be made, from 1.
            retry_after: The server's `Retry-After` header: whole seconds or an
                HTTP date. When usable it sets the delay (capped at
                `max_backoff`, no jitter); otherwise the jittered backoff applies.

        Returns:
            The delay in seconds.
        """
        seconds = parse_retry_after(retry_after)
        if seconds is not None:
            return min(self.max_backoff, seconds)
        base = min(self.max_backoff, self.backoff * 2 ** (retry - 1))
        return base * random.uniform(0.5, 1.0)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from now that a `Retry-After` header asks for, or `None` when unusable.

    Args:
        value: The header: a non-negative whole number of seconds, or an HTTP
            date (a date in the past means `0`).

    Returns:
        The seconds, or `None` for a missing or malformed header.

    Examples:
        >>> parse_retry_after("3"), parse_retry_after("-1"), parse_retry_after(None)
        (3.0, None, None)
    """
    if value is None:
        return None
    value = value.strip()
    # ASCII digits only (RFC 9110): str.isdigit() alone also accepts "³",
    # which float() refuses. A huge number becomes inf, capped by the caller.
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


class _LoopState:
    """What belongs to one event loop: its session and its semaphore."""

    def __init__(self, session: aiohttp.ClientSession, semaphore: asyncio.Semaphore, owned: bool) -> None:
        self.session = session
        self.semaphore = semaphore
        self.owned = owned
        self.closer: Any = None


async def _close_at_loop_shutdown(session: aiohttp.ClientSession) -> AsyncIterator[None]:
    try:
        yield
    finally:
        if not session.closed:
            await session.close()


class _BodyTooLarge(Exception):
    pass


class HttpTransport:
    """Requests to one server with retries, under a body cap, one session per loop.

    Without `session`, one `aiohttp.ClientSession` is created lazily per event
    loop and closed when that loop shuts down (or by `close`); a closed session,
    or one from another loop, is never reused. With `session`, that session is
    used as it is and never closed. The transport pickles (without sessions) and
    works again wherever it is unpickled, unless it holds a user's session.

    Args:
        base_url: The validated server URL, without a trailing slash.
        config: Retries, timeouts, concurrency, the body cap, headers and
            the session options (`TransportConfig`, checked there).
    """

    def __init__(self, base_url: str, config: TransportConfig) -> None:
        self.base_url = base_url
        self.config = config
        self.headers = dict(config.headers or {})
        self.ssl = config.ssl
        self.trace_configs = list(config.trace_configs) if config.trace_configs is not None else None
        self._user_session = config.session
        self._init_loop_state()

    def _init_loop_state(self) -> None:
        self._lock = threading.Lock()
        # Keyed weakly by loop: a loop that is gone takes its entry with it.
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        if self._user_session is not None:
            raise TypeError("a client built with session= cannot be pickled: the session belongs to its event loop")
        state = self.__dict__.copy()
        del state["_lock"], state["_states"]  # loop-bound; rebuilt lazily after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_loop_state()

    async def state(self) -> _LoopState:
        """This event loop's session and semaphore, created on first use."""
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._states.get(loop)
            if state is not None and (not state.session.closed or not state.owned):
                return state
            self._reap_dead_loops()
            c = self.config
            semaphore = asyncio.Semaphore(c.max_concurrency)
            if self._user_session is not None:
                state = self._states[loop] = _LoopState(self._user_session, semaphore, owned=False)
                return state
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=c.max_concurrency, ssl=self.ssl),
                timeout=aiohttp.ClientTimeout(total=c.timeout, connect=c.connect_timeout),
                headers=self.headers,
                trace_configs=self.trace_configs,
            )
            state = self._states[loop] = _LoopState(session, semaphore, owned=True)
        # A client may outlive its loop (one asyncio.run per training step):
        # this suspended async generator is finalized by the loop's
        # shutdown_asyncgens() (asyncio.run calls it) while the loop still
        # runs, and closes the session there. No leak, no warning.
        state.closer = _close_at_loop_shutdown(session)
        await state.closer.asend(None)
        return state

    def _reap_dead_loops(self) -> None:
        # Fallback for loops closed without shutdown_asyncgens(): their sessions
        # can no longer be closed on their loop; detach so they are never reused.
        for loop, state in list(self._states.items()):
            if loop.is_closed():
                if state.owned and not state.session.closed:
                    state.session.detach()
                del self._states[loop]

    async def close(self) -> None:
        """Close this event loop's own session (a user's session is left open)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._states.pop(loop, None)
        if state is not None and state.owned:
            await state.session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        *,
        parse: Callable[[bytearray], Any] = json.loads,
    ) -> Any:
        """Send one request with the configured retries.

        Args:
            method: `"GET"` or `"POST"`.
            path: Appended to the base URL.
            body: Sent as JSON when not `None` (serialised once, before the
                first attempt).
            headers: Extra headers for this request.
            parse: Reads the `2xx` body: `json.loads`, or a parser that raises
                what it raises (`ValueError`, `RecursionError`, `MemoryError`)
                for a body that is not JSON, such as
                `torch_r3.rollout.protocols.spans.parse_body`.

        Returns:
            The parsed JSON of the `2xx` answer.

        Raises:
            TypeError: `body` holds something JSON cannot carry (nothing is sent).
            ValueError: `body` holds a NaN or infinite number (nothing is sent).
            RemoteGenerateError: Every failure of the request, naming the URL.
        """
        url = self.base_url + path
        data, extra = _encode_body(method, url, body, headers)
        state = await self.state()
        if state.session.closed:
            raise RemoteGenerateError(
                f"{method} {url}: the aiohttp session is closed", url=url, status=None, attempts=0
            )
        if not state.owned:
            extra = {**self.headers, **extra}
        call = _Call(method, url, data, extra, state)
        answer = await self._with_retries(call)
        return _parse_json(answer, call, parse)

    async def _with_retries(self, call: _Call) -> _Answer:
        """The retry policy: attempts until a final answer, a final error, or the budget is spent."""
        c = self.config
        last_cause, last_status = "none", None
        last_exc: BaseException | None = None
        retry_after: str | None = None
        for attempt in range(1, c.retries + 2):
            if attempt > 1:
                delay = c.delay(attempt - 1, retry_after)
                log.warning(
                    "%s %s: attempt %d of %d failed (%s); retry in %.3g s",
                    call.method,
                    call.url,
                    attempt - 1,
                    c.retries + 1,
                    last_cause,
                    delay,
                )
                await asyncio.sleep(delay)
            call.attempts = attempt
            try:
                answer = await self._attempt(call)
            except Exception as exc:
                outcome, message, status = _translate(exc, call)
                if not outcome.retryable:
                    raise RemoteGenerateError(
                        f"{call.method} {call.url}{message}", url=call.url, status=status, attempts=attempt
                    ) from (exc if outcome.chained else None)
                last_cause, last_status, last_exc, retry_after = _describe(exc), None, exc, None
                continue
            if answer.status not in RETRYABLE_STATUSES:
                return answer
            last_cause, last_status, last_exc = (
                f"HTTP {answer.status}: {server_message(answer.payload)}",
                answer.status,
                None,
            )
            retry_after = answer.retry_after
        raise RemoteGenerateError(
            f"{call.method} {call.url} failed after {call.attempts} attempt(s); last cause: {last_cause}",
            url=call.url,
            status=last_status,
            attempts=call.attempts,
        ) from last_exc

    async def _attempt(self, call: _Call) -> _Answer:
        """One request and its body, read under the cap (`ERROR_BODY_BYTES` for an error status)."""
        c = self.config
        # Per request, so that a user's session gets the same limits.
        timeout = aiohttp.ClientTimeout(total=c.timeout, connect=c.connect_timeout)
        call.status = None
        async with (
            call.state.semaphore,
            # Redirects are never followed: a POST re-sent to another origin
            # would carry its body and custom headers there (aiohttp strips
            # only Authorization and Cookie), and a 302/303 would turn it into
            # a GET whose answer is not the generation asked for.
            call.state.session.request(
                call.method, call.url, data=call.data, headers=call.headers, timeout=timeout, allow_redirects=False
            ) as response,
        ):
            call.status = status = response.status
            retry_after = response.headers.get("Retry-After") if status in RETRYABLE_STATUSES else None
            location = response.headers.get("Location") if 300 <= status < 400 else None
            ok = 200 <= status < 300
            payload = await _read_capped(response, c.max_response_bytes if ok else ERROR_BODY_BYTES, ok)
        return _Answer(status, payload, retry_after, location)


@dataclass
class _Call:
    """One logical request across its attempts."""

    method: str
    url: str
    data: bytes | None
    headers: dict[str, str]
    state: _LoopState
    attempts: int = 0
    status: int | None = None


@dataclass(frozen=True)
class _Answer:
    """What one attempt received: the status and the (capped) body."""

    status: int
    payload: bytearray
    retry_after: str | None
    location: str | None = None


def _encode_body(
    method: str, url: str, body: Any, headers: Mapping[str, str] | None
) -> tuple[bytes | None, dict[str, str]]:
    extra = dict(headers or {})
    if body is None:
        return None, extra
    try:
        data = json.dumps(body, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{method} {url}: the request body cannot be sent as JSON: {exc}") from None
    extra["Content-Type"] = "application/json"
    return data, extra


@dataclass(frozen=True)
class _Outcome:
    """How one kind of exception from an attempt is translated."""

    retryable: bool
    message: str = ""  # after "METHOD URL"; {exc} and {cause} are filled in
    keeps_status: bool = False  # report the status of the response being read
    chained: bool = True  # keep the exception as __cause__


# The one table that translates an attempt's exception. First match wins, so
# subclasses come first. aiohttp.ClientPayloadError (the connection broke
# while the body was read) is not a ClientConnectionError subclass, but it is
# the same failure.
_EXCEPTIONS: tuple[tuple[type[BaseException], _Outcome], ...] = (
    (_BodyTooLarge, _Outcome(False, ": {exc}", keeps_status=True, chained=False)),
    (
        MemoryError,
        _Outcome(
            False,
            ": out of memory reading the response body (lower max_response_bytes?)",
            keeps_status=True,
            chained=False,
        ),
    ),
    (aiohttp.ClientConnectionError, _Outcome(True)),
    (aiohttp.ClientPayloadError, _Outcome(True)),
    (asyncio.TimeoutError, _Outcome(True)),
    (aiohttp.ClientError, _Outcome(False, " failed: {cause}")),  # invalid URL or response, ...: not transient
    # aiohttp's answer to a user's session used outside the loop that created it.
    (
        RuntimeError,
        _Outcome(
            False, ": the given aiohttp session cannot be used here ({exc}); use it on the event loop that created it"
        ),
    ),
)


def _translate(exc: Exception, call: _Call) -> tuple[_Outcome, str, int | None]:
    """The table's outcome for an attempt's exception, its message and status; re-raises one it does not know."""
    for kind, outcome in _EXCEPTIONS:
        if not isinstance(exc, kind):
            continue
        if kind is RuntimeError and call.state.owned:
            raise exc  # our own session: a bug, not the user's session on a wrong loop
        status = call.status if outcome.keeps_status else None
        return outcome, outcome.message.format(exc=exc, cause=_describe(exc)), status
    raise exc


def _parse_json(answer: _Answer, call: _Call, parse: Callable[[bytearray], Any]) -> Any:
    """The parsed JSON of a final answer; an error status or a body that is not JSON is an error."""
    status, payload = answer.status, answer.payload
    where = f"{call.method} {call.url}"
    if 300 <= status < 400:
        raise RemoteGenerateError(
            f"{where} answered HTTP {status}, a redirect to {answer.location!r}, which is not followed "
            "(re-sending the request elsewhere could leak its body and headers): set base_url to the "
            "server that answers, or fix the proxy in front of it",
            url=call.url,
            status=status,
            attempts=call.attempts,
        )
    if not 200 <= status < 300:
        raise RemoteGenerateError(
            f"{where} failed with HTTP {status}: {server_message(payload)}",
            url=call.url,
            status=status,
            attempts=call.attempts,
        )
    cause: ValueError | None = None
    try:
        return parse(payload)
    except MemoryError:
        problem = f": out of memory parsing a JSON body of {len(payload)} bytes"
    except RecursionError:
        problem = f" answered {status} with JSON nested too deeply to parse ({len(payload)} bytes)"
    except ValueError as exc:
        problem = f" answered {status} with a body that is not valid JSON ({len(payload)} bytes): {exc}"
        cause = exc
    raise RemoteGenerateError(f"{where}{problem}", url=call.url, status=status, attempts=call.attempts) from cause


async def _read_capped(response: aiohttp.ClientResponse, cap: int, strict: bool) -> bytearray:
    """The body, read in chunks; over `cap` bytes: `_BodyTooLarge` when `strict`, else the first `cap`."""
    declared = response.content_length
    if strict and declared is not None and declared > cap:
        raise _BodyTooLarge(f"response body of Content-Length {declared} exceeds max_response_bytes={cap}")
    # The buffer grows with the bytes that arrived, never from the declared
    # length: a server that declares 256 MiB and stalls costs nothing.
    buffer = bytearray()
    async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
        if len(buffer) + len(chunk) > cap:
            if strict:
                raise _BodyTooLarge(f"response body has more than max_response_bytes={cap} bytes")
            buffer += chunk[: cap - len(buffer)]
            return buffer
        buffer += chunk
    return buffer  # not copied to bytes: json.loads reads a bytearray as it is


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def server_message(payload: bytes | bytearray) -> str:
    """The server's `error.message` (or `error`, `detail`), else the start of its body.

    Args:
        payload: The (possibly truncated) body of an error answer.

    Returns:
        A one-line message for `RemoteGenerateError`.

    Examples:
        >>> server_message(b'{"error": {"message": "bad token"}}')
        'bad token'
    """
    try:
        parsed = json.loads(payload)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        for key in ("error", "detail", "message"):
            if isinstance(parsed.get(key), str):
                return parsed[key]
    text = payload[:500].decode("utf-8", errors="replace").strip()
    return text + ("..." if len(payload) > 500 else "") if text else "(empty body)"
