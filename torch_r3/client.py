"""The HTTP client to the inference server: ``RemoteGenerateClient``.

One ``POST {base_url}/v1/generate`` per call, in DESIGN.md's wire format; the
routes come back decoded by :func:`torch_r3.codec.decode_routes`. Transport
concerns live in :class:`TransportConfig` (validated once); the request path
(:meth:`RemoteGenerateClient.generate`) only builds the body and reads the
answer.

Transient failures are retried with exponential backoff and jitter: every
``aiohttp.ClientConnectionError`` (refused connection during a restart, server
disconnect, OS errors), a connection dropped mid-body, a timeout, and the
statuses 502, 503 and 504. A 4xx is never retried.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch_r3._extras import require

require("aiohttp", "client")  # without aiohttp: name the extra that installs it
import aiohttp  # noqa: E402
import numpy as np

from torch_r3.codec import decode_routes

__all__ = ["RemoteGenerateClient", "RemoteGenerateError", "RemoteGenerateResult", "TransportConfig"]

GENERATE_PATH = "/v1/generate"
MODEL_INFO_PATH = "/v1/model_info"
RETRYABLE_STATUSES = frozenset({502, 503, 504})
# aiohttp.ClientPayloadError: the connection broke while the body was read (it
# is not a ClientConnectionError subclass, but it is the same failure).
_TRANSIENT = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class RemoteGenerateError(RuntimeError):
    """A generate call failed for good: a non-retryable answer, or retries exhausted.

    The message names the URL and the last cause; the cause is also chained
    (``__cause__``) when it was an exception.

    Attributes:
        url: The URL that was posted to.
        status: The last HTTP status, or ``None`` when no response arrived.
        attempts: Attempts made.
    """

    def __init__(self, message: str, *, url: str, status: int | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.attempts = attempts


@dataclass(frozen=True, eq=False)
class RemoteGenerateResult:
    """One generate call's answer (the first choice).

    Attributes:
        response_ids: The generated token ids.
        response_logprobs: Their logprobs, or ``None`` when the server sent none.
        stop_reason: The server's ``finish_reason`` (e.g. ``"stop"``, ``"length"``).
        routed_experts: The routes ``[rows, layers, topk]`` of positions
            ``routed_experts_prompt_start .. len(prompt) + len(response_ids) - 2``,
            a canonical NumPy array, or ``None`` when not requested.
        raw: The parsed JSON response, untouched.
    """

    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    stop_reason: str | None
    routed_experts: np.ndarray | None
    raw: dict[str, Any]


@dataclass(frozen=True)
class TransportConfig:
    """Retries, backoff, timeouts and concurrency of a :class:`RemoteGenerateClient`.

    Attributes:
        retries: Retries after the first attempt (``0``: try once).
        backoff: Base delay in seconds; retry ``n`` (from 1) waits
            ``min(max_backoff, backoff * 2**(n-1))`` scaled by a random factor in
            ``[0.5, 1.0]`` (jitter, so restarted servers are not hit in lockstep).
        max_backoff: Cap on one delay, in seconds.
        timeout: Seconds one attempt may take in total (connect, send, generate,
            read); ``None`` for no limit. Generation can be slow: keep it generous.
        connect_timeout: Seconds to establish a connection; ``None`` for no
            separate limit.
        max_concurrency: Requests in flight at once per event loop (also the
            connection pool size).
    """

    retries: int = 5
    backoff: float = 0.5
    max_backoff: float = 10.0
    timeout: float | None = 600.0
    connect_timeout: float | None = 30.0
    max_concurrency: int = 64

    def __post_init__(self) -> None:
        for name in ("retries", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        for name in ("backoff", "max_backoff", "timeout", "connect_timeout"):
            value = getattr(self, name)
            if value is None and name in ("timeout", "connect_timeout"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
            if not value >= 0 or (name.endswith("timeout") and value == 0):
                raise ValueError(f"{name} must be {'> 0' if name.endswith('timeout') else '>= 0'}, got {value}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based), jitter included."""
        base = min(self.max_backoff, self.backoff * 2 ** (retry - 1))
        return base * random.uniform(0.5, 1.0)


class _LoopState:
    """What belongs to one event loop: its session and its semaphore."""

    def __init__(self, session: aiohttp.ClientSession, semaphore: asyncio.Semaphore) -> None:
        self.session = session
        self.semaphore = semaphore
        self.closer: Any = None


async def _close_at_loop_shutdown(session: aiohttp.ClientSession):
    try:
        yield
    finally:
        if not session.closed:
            await session.close()


class RemoteGenerateClient:
    """An ``aiohttp`` client for the inference server's generate endpoint.

    Use it as ``async with RemoteGenerateClient(url) as client:``, or call
    :meth:`close` yourself. One ``aiohttp.ClientSession`` is created lazily per
    event loop; a closed session, or one from another loop, is never reused.
    The client pickles (without sessions or semaphores) and works again in the
    process and loop where it is unpickled.

    Args:
        base_url: The server, e.g. ``"http://127.0.0.1:30000"``; requests go to
            ``{base_url}/v1/generate``.
        retries: See :class:`TransportConfig`.
        backoff: See :class:`TransportConfig`.
        max_backoff: See :class:`TransportConfig`.
        timeout: See :class:`TransportConfig`.
        connect_timeout: See :class:`TransportConfig`.
        max_concurrency: See :class:`TransportConfig`.
        headers: Extra headers sent with every request (e.g. authorization).

    Example:
        >>> import asyncio
        >>> from torch_r3.testing import LoopbackServer
        >>> async def main(url):
        ...     async with RemoteGenerateClient(url, retries=2) as client:
        ...         r = await client.generate([1, 2, 3], {"max_new_tokens": 2}, return_routed_experts=True)
        ...         return len(r.response_ids), r.routed_experts.shape
        >>> with LoopbackServer() as server:
        ...     asyncio.run(main(server.url))
        (2, (4, 2, 2))
    """

    def __init__(
        self,
        base_url: str,
        *,
        retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        timeout: float | None = 600.0,
        connect_timeout: float | None = 30.0,
        max_concurrency: int = 64,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(base_url, str):
            raise TypeError(f"base_url must be a str, got {type(base_url).__name__}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.transport = TransportConfig(
            retries=retries,
            backoff=backoff,
            max_backoff=max_backoff,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_concurrency=max_concurrency,
        )
        self.headers = dict(headers or {})
        self._init_loop_state()

    @property
    def url(self) -> str:
        """The generate endpoint, ``{base_url}/v1/generate``."""
        return self.base_url + GENERATE_PATH

    # -- sessions, one per event loop -----------------------------------------

    def _init_loop_state(self) -> None:
        self._lock = threading.Lock()
        # Keyed weakly by loop: a loop that is gone takes its entry with it.
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()

    async def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._states.get(loop)
            if state is not None and not state.session.closed:
                return state
            self._reap_dead_loops()
            t = self.transport
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=t.max_concurrency),
                timeout=aiohttp.ClientTimeout(total=t.timeout, connect=t.connect_timeout),
                headers=self.headers,
            )
            state = self._states[loop] = _LoopState(session, asyncio.Semaphore(t.max_concurrency))
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
                if not state.session.closed:
                    state.session.detach()
                del self._states[loop]

    async def close(self) -> None:
        """Close this event loop's session (other loops' sessions are theirs to close)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._states.pop(loop, None)
        if state is not None:
            await state.session.close()

    async def __aenter__(self) -> RemoteGenerateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"], state["_states"]  # loop-bound; rebuilt lazily after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_loop_state()

    def __repr__(self) -> str:
        return f"RemoteGenerateClient({self.base_url!r}, {self.transport})"

    # -- the request path -------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool = False,
        routed_experts_prompt_start: int | None = None,
        session_id: str | None = None,
        model: str | None = None,
    ) -> RemoteGenerateResult:
        """Generate a continuation of ``prompt_token_ids``.

        Args:
            prompt_token_ids: The prompt: a list, tuple, 1-D integer array or tensor.
            sampling_params: Passed to the server as they are.
            return_routed_experts: Ask for the routes.
            routed_experts_prompt_start: Return routes only for positions from
                here on (in a multi-turn rollout, :attr:`RoutedExpertTrace.prompt_start
                <torch_r3.trace.RoutedExpertTrace.prompt_start>`); an ``int`` in
                ``[0, len(prompt)]``. Requires ``return_routed_experts=True``.
                Sent inside ``sampling_params``.
            session_id: Sent as the ``X-Session-ID`` header (sticky routing).
            model: Sent as the body's ``model`` field.

        Returns:
            The decoded first choice; with routes, their row count is checked
            against ``len(prompt) + len(response_ids) - 1 - routed_experts_prompt_start``.

        Raises:
            TypeError: an argument of the wrong kind (a ``bool`` prompt start included).
            ValueError: ``routed_experts_prompt_start`` out of range, or given
                without ``return_routed_experts=True`` or inside ``sampling_params``.
            RemoteGenerateError: a 4xx or other non-retryable answer, a response
                that breaks the wire format, or retries exhausted.
        """
        prompt = _token_list(prompt_token_ids)
        params = _sampling_params(sampling_params)
        if not isinstance(return_routed_experts, bool):
            raise TypeError(f"return_routed_experts must be a bool, got {type(return_routed_experts).__name__}")
        start = 0
        if routed_experts_prompt_start is not None:
            start = routed_experts_prompt_start
            if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
                raise TypeError(f"routed_experts_prompt_start must be an int, got {type(start).__name__}")
            if not 0 <= start <= len(prompt):
                raise ValueError(f"routed_experts_prompt_start must be in [0, len(prompt)={len(prompt)}], got {start}")
            if not return_routed_experts:
                raise ValueError("routed_experts_prompt_start requires return_routed_experts=True")
            params["routed_experts_prompt_start"] = start = int(start)
        body: dict[str, Any] = {
            "token_ids": prompt,
            "sampling_params": params,
            "return_routed_experts": return_routed_experts,
        }
        if model is not None:
            if not isinstance(model, str):
                raise TypeError(f"model must be a str, got {type(model).__name__}")
            body["model"] = model
        headers = {}
        if session_id is not None:
            if not isinstance(session_id, str):
                raise TypeError(f"session_id must be a str, got {type(session_id).__name__}")
            headers["X-Session-ID"] = session_id
        raw = await self._post(body, headers)
        return self._parse(raw, prompt_len=len(prompt), start=start, want_routes=return_routed_experts)

    async def model_info(self) -> dict[str, Any]:
        """The served model's routing shape: ``GET {base_url}/v1/model_info``.

        Returns:
            The server's JSON object, with at least ``num_layers`` (MoE layers),
            ``num_experts`` and ``topk``: what a trainer checks before it
            replays the server's routes in its own model.

        Raises:
            RemoteGenerateError: as :meth:`generate` (same retries), or when the
                answer lacks those integer fields.
        """
        raw = await self._request("GET", MODEL_INFO_PATH, None, {})
        url = self.base_url + MODEL_INFO_PATH
        if not isinstance(raw, Mapping):
            raise RemoteGenerateError(f"GET {url}: expected a JSON object, got {type(raw).__name__}", url=url, status=200)
        for key in ("num_layers", "num_experts", "topk"):
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RemoteGenerateError(f"GET {url}: {key!r} must be a positive int, got {value!r}", url=url, status=200)
        return dict(raw)

    async def _post(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """POST to the generate endpoint with retries; the parsed JSON of a 2xx answer."""
        return await self._request("POST", GENERATE_PATH, body, headers)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]) -> Any:
        """One request with the transport's retries; returns the parsed JSON of a 2xx answer."""
        state = await self._state()
        url, t = self.base_url + path, self.transport
        attempts, last_cause, last_status = 0, "none", None
        last_exc: BaseException | None = None
        for attempt in range(t.retries + 1):
            if attempt:
                await asyncio.sleep(t.delay(attempt))
            attempts += 1
            try:
                async with state.semaphore:
                    async with state.session.request(method, url, json=body, headers=headers) as response:
                        status = response.status
                        payload = await response.read()
            except _TRANSIENT as exc:
                last_cause, last_status = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, None
                last_exc = exc
                continue
            if status in RETRYABLE_STATUSES:
                last_cause, last_status, last_exc = f"HTTP {status}: {_server_message(payload)}", status, None
                continue
            if not 200 <= status < 300:
                raise RemoteGenerateError(
                    f"{method} {url} failed with HTTP {status}: {_server_message(payload)}",
                    url=url, status=status, attempts=attempts,
                )
            try:
                return json.loads(payload)
            except ValueError as exc:
                raise RemoteGenerateError(
                    f"{method} {url} answered {status} with a body that is not valid JSON "
                    f"({len(payload)} bytes): {exc}",
                    url=url, status=status, attempts=attempts,
                ) from exc
        raise RemoteGenerateError(
            f"{method} {url} failed after {attempts} attempt(s); last cause: {last_cause}",
            url=url, status=last_status, attempts=attempts,
        ) from last_exc

    def _parse(self, raw: Any, *, prompt_len: int, start: int, want_routes: bool) -> RemoteGenerateResult:
        url = self.url
        try:
            choice = _first_choice(raw)
            ids = choice.get("token_ids")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("choices[0].token_ids must be a list of ints")
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                if not isinstance(logprobs, list) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs
                ):
                    raise TypeError("choices[0].logprobs must be a list of numbers or null")
                if len(logprobs) != len(ids):
                    raise ValueError(f"choices[0].logprobs has {len(logprobs)} entries for {len(ids)} tokens")
                logprobs = tuple(float(x) for x in logprobs)
            reason = choice.get("finish_reason")
            if reason is not None and not isinstance(reason, str):
                raise TypeError("choices[0].finish_reason must be a string or null")
            routes = None
            envelope = choice.get("routed_experts")
            if want_routes:
                if envelope is None:
                    raise ValueError("routes were requested but choices[0].routed_experts is null or missing")
                routes = decode_routes(envelope, name="choices[0].routed_experts")
                expected = max(0, prompt_len + len(ids) - 1 - start)
                if routes.shape[0] != expected:
                    raise ValueError(
                        f"choices[0].routed_experts has {routes.shape[0]} rows; positions {start} .. "
                        f"{prompt_len + len(ids) - 2} need {expected}"
                    )
        except (TypeError, ValueError) as exc:
            raise RemoteGenerateError(f"POST {url}: response breaks the wire format: {exc}", url=url, status=200) from exc
        return RemoteGenerateResult(
            response_ids=tuple(ids),
            response_logprobs=logprobs,
            stop_reason=reason,
            routed_experts=routes,
            raw=raw,
        )


def _first_choice(raw: Any) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
    choices = raw.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError("expected a non-empty 'choices' list")
    if not isinstance(choices[0], dict):
        raise TypeError("choices[0] must be an object")
    return choices[0]


def _token_list(tokens: Any) -> list[int]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"prompt_token_ids: expected a 1-D integer array, got {tokens.ndim}-D {tokens.dtype}")
        return tokens.tolist()
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"prompt_token_ids: expected a list of ints, got {type(tokens).__name__}")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"prompt_token_ids[{i}]: expected an int, got {type(t).__name__}")
    return [int(t) for t in tokens]


def _sampling_params(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise TypeError(f"sampling_params: expected a mapping, got {type(params).__name__}")
    if "routed_experts_prompt_start" in params:
        raise ValueError("pass routed_experts_prompt_start as the keyword argument, not inside sampling_params")
    return dict(params)


def _server_message(payload: bytes) -> str:
    """The server's ``error.message``, else the start of its body."""
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
    text = payload[:500].decode("utf-8", errors="replace").strip()
    return text + ("..." if len(payload) > 500 else "") if text else "(empty body)"
