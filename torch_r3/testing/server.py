"""An ``aiohttp.web`` inference server on loopback, with fault injection.

It serves ``POST /v1/generate`` in DESIGN.md's wire format from a
:class:`~torch_r3.testing.model.ServedModel`, returning the genuine routes of
every position the model evaluated from ``routed_experts_prompt_start`` on.
Tests run it in-process on ``127.0.0.1``: nothing is mocked at the HTTP layer.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch_r3._extras import require

require("aiohttp", "testing")  # without aiohttp: name the extra that installs it
from aiohttp import web  # noqa: E402

from torch_r3.codec import encode_routes
from torch_r3.testing.model import ServedModel, TinyMoELM

__all__ = ["Faults", "LoopbackServer", "ServerStats", "make_app"]

GENERATE_PATH = "/v1/generate"
MODEL_INFO_PATH = "/v1/model_info"


class Faults:
    """Faults to inject, consumed in order by the next requests (thread-safe).

    Connection refusals apply to new TCP connections; every other fault applies
    to the next request that reaches the handler, one fault per request, in the
    order they were queued.

    Example:
        >>> faults = Faults()
        >>> faults.status(503, n=2)
        >>> faults.stall(5.0)
        >>> faults.pending
        3
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._refuse = 0

    def refuse_connections(self, n: int = 1) -> None:
        """Reset the next ``n`` TCP connections as soon as they are accepted.

        The client sees a connection-level error (``ClientOSError`` /
        ``ServerDisconnectedError``) before any byte of a response, as it would
        for a server that is not up yet. (For a genuinely closed port, see
        :meth:`LoopbackServer.restart`.)
        """
        with self._lock:
            self._refuse += _count(n)

    def disconnect(self, n: int = 1) -> None:
        """Send the status line, headers and half the body, then drop the connection."""
        self._push("disconnect", n)

    def status(self, code: int, n: int = 1, *, message: str | None = None, json_error: bool = True) -> None:
        """Answer with HTTP ``code``: a ``{"error": {"message"}}`` body, or plain text when ``json_error=False``."""
        if isinstance(code, bool) or not isinstance(code, int) or not 100 <= code <= 599:
            raise ValueError(f"code must be an HTTP status int, got {code!r}")
        self._push("status", n, code=code, message=message or f"injected {code}", json_error=json_error)

    def truncate(self, n: int = 1) -> None:
        """Answer ``200`` with a complete HTTP body holding only the first half of the JSON."""
        self._push("truncate", n)

    def malformed(self, n: int = 1) -> None:
        """Answer ``200`` with valid JSON whose route envelope claims one row more than its data holds."""
        self._push("malformed", n)

    def stall(self, seconds: float, n: int = 1) -> None:
        """Wait ``seconds`` before handling the request (to outlast a client timeout)."""
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self._push("stall", n, seconds=float(seconds))

    def clear(self) -> None:
        """Drop every pending fault."""
        with self._lock:
            self._queue.clear()
            self._refuse = 0

    @property
    def pending(self) -> int:
        """Faults not yet consumed (connection refusals included)."""
        with self._lock:
            return len(self._queue) + self._refuse

    def _push(self, kind: str, n: int, **args: Any) -> None:
        with self._lock:
            self._queue.extend((kind, args) for _ in range(_count(n)))

    def _next(self) -> tuple[str, dict[str, Any]] | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def _take_refusal(self) -> bool:
        with self._lock:
            if self._refuse:
                self._refuse -= 1
                return True
            return False


def _count(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return n


@dataclass
class ServerStats:
    """What the server saw, counted server-side (read it after the requests finish).

    Attributes:
        connections_refused: TCP connections reset by :meth:`Faults.refuse_connections`.
        requests: Requests that reached the generate handler (faulted ones included).
        generations: Requests the model generated for (answered ``200``,
            including the ``disconnect``/``truncate``/``malformed`` faults).
        route_rows: Route rows put on the wire, over all generations.
        route_bytes: Decoded route bytes put on the wire (rows * layers * topk * itemsize).
        session_ids: The ``X-Session-ID`` of every generation, in order (``None`` when absent).
        in_flight: Requests inside the handler right now.
        max_in_flight: The most requests that were inside the handler at once.
    """

    connections_refused: int = 0
    requests: int = 0
    generations: int = 0
    route_rows: int = 0
    route_bytes: int = 0
    session_ids: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def make_app(model: ServedModel, *, faults: Faults | None = None, stats: ServerStats | None = None) -> web.Application:
    """The ``aiohttp.web`` application serving ``POST /v1/generate`` from ``model``.

    ``GET /v1/model_info`` answers the model's ``num_layers``, ``num_experts``
    and ``topk``.

    Args:
        model: The :class:`~torch_r3.testing.model.ServedModel` to generate with.
        faults: Faults to inject (none when ``None``).
        stats: Counters to update (a private one when ``None``).

    Returns:
        An application to run with ``aiohttp.web.AppRunner`` (or use
        :class:`LoopbackServer`, which does it for you).
    """
    if not isinstance(model, ServedModel):
        raise TypeError(f"model must implement torch_r3.testing.ServedModel, got {type(model).__name__}")
    faults = faults if faults is not None else Faults()
    stats = stats if stats is not None else ServerStats()

    async def generate(request: web.Request) -> web.StreamResponse:
        stats.requests += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            return await _generate(request)
        finally:
            stats.in_flight -= 1

    async def _generate(request: web.Request) -> web.StreamResponse:
        fault = faults._next()
        kind, args = fault if fault else (None, {})
        if kind == "stall":
            await asyncio.sleep(args["seconds"])
        elif kind == "status":
            if args["json_error"]:
                return web.json_response({"error": {"message": args["message"]}}, status=args["code"])
            return web.Response(text=args["message"], status=args["code"], content_type="text/plain")
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"request body is not JSON: {exc}")
        try:
            prompt, params, want_routes, start = _parse_request(body, model)
            out = model.generate(prompt, params)
        except (TypeError, ValueError) as exc:
            return _error(400, str(exc))
        envelope = None
        if want_routes:
            expected = len(prompt) + len(out.token_ids) - 1
            if out.routes.shape[0] != expected:  # a broken ServedModel, not a client error
                return _error(500, f"model returned {out.routes.shape[0]} route rows, expected {expected}")
            rows = out.routes[start:]
            envelope = encode_routes(rows)
            if kind == "malformed":
                envelope["shape"][0] += 1
        payload = {
            "choices": [
                {
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "logprobs": out.logprobs,
                    "routed_experts": envelope,
                }
            ]
        }
        text = json.dumps(payload).encode()
        stats.generations += 1
        stats.session_ids.append(request.headers.get("X-Session-ID"))
        if envelope is not None:
            stats.route_rows += rows.shape[0]
            stats.route_bytes += len(envelope["data"]) // 4 * 3 - envelope["data"][-2:].count("=")
        if kind == "truncate":
            return web.Response(body=text[: len(text) // 2], content_type="application/json")
        if kind == "disconnect":
            response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            response.content_length = len(text)
            await response.prepare(request)
            await response.write(text[: len(text) // 2])
            _reset(request.transport)
            return response
        return web.Response(body=text, content_type="application/json")

    async def model_info(request: web.Request) -> web.Response:
        # What a trainer checks before replaying these routes in its own model.
        return web.json_response(
            {"num_layers": model.num_layers, "num_experts": model.num_experts, "topk": model.topk}
        )

    app = web.Application()
    app.router.add_post(GENERATE_PATH, generate)
    app.router.add_get(MODEL_INFO_PATH, model_info)
    return app


def _parse_request(body: Any, model: ServedModel) -> tuple[list[int], dict[str, Any], bool, int]:
    if not isinstance(body, Mapping):
        raise TypeError(f"request body must be a JSON object, got {type(body).__name__}")
    for key in ("token_ids",):
        if key not in body:
            raise ValueError(f"request body is missing {key!r}")
    unknown = sorted(set(body) - {"token_ids", "sampling_params", "return_routed_experts", "model"})
    if unknown:
        raise ValueError(f"unknown request fields {unknown}")
    prompt = body["token_ids"]
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise TypeError("token_ids must be a list of ints")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise TypeError(f"sampling_params must be an object, got {type(params).__name__}")
    want_routes = body.get("return_routed_experts", False)
    if not isinstance(want_routes, bool):
        raise TypeError("return_routed_experts must be a bool")
    if "model" in body and not isinstance(body["model"], str):
        raise TypeError("model must be a string")
    start = params.get("routed_experts_prompt_start", 0)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(prompt):
        raise ValueError(f"routed_experts_prompt_start must be an int in [0, {len(prompt)}], got {start!r}")
    if "routed_experts_prompt_start" in params and not want_routes:
        raise ValueError("routed_experts_prompt_start requires return_routed_experts=true")
    return prompt, params, want_routes, start


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Close with a TCP RST (SO_LINGER 0) instead of a clean FIN."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # pragma: no cover - already gone
            pass
    transport.abort()


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _reset(transport)


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class LoopbackServer:
    """The test server on ``127.0.0.1``, in-process, on a free port.

    Use ``with`` from synchronous code (the server runs its own event loop in a
    background thread) or ``async with`` from a coroutine (it runs on the
    current loop).

    Args:
        model: The model to serve; a seeded :class:`~torch_r3.testing.model.TinyMoELM` by default.
        faults: Faults to inject; a fresh :class:`Faults` by default (see :attr:`faults`).
        host: Address to bind.
        port: Port to bind; ``0`` picks a free one (see :attr:`port`).
        shutdown_timeout: Seconds in-flight requests get to finish on stop or restart.

    Example:
        >>> import asyncio
        >>> from torch_r3.client import RemoteGenerateClient
        >>> with LoopbackServer() as server:
        ...     async def main():
        ...         async with RemoteGenerateClient(server.url) as client:
        ...             return await client.generate([1, 2, 3], {"max_new_tokens": 2}, return_routed_experts=True)
        ...     result = asyncio.run(main())
        >>> result.routed_experts.shape  # positions 0 .. 3 + 2 - 2
        (4, 2, 2)
    """

    def __init__(
        self,
        model: ServedModel | None = None,
        *,
        faults: Faults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 1.0,
    ) -> None:
        self.model = model if model is not None else TinyMoELM()
        if not isinstance(self.model, ServedModel):
            raise TypeError(f"model must implement torch_r3.testing.ServedModel, got {type(self.model).__name__}")
        self.faults = faults if faults is not None else Faults()
        self.stats = ServerStats()
        self.host = host
        self.port = port
        self._shutdown_timeout = shutdown_timeout
        self._runner: web.AppRunner | None = None
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port``, the client's ``base_url``."""
        return f"http://{self.host}:{self.port}"

    # -- listening, on the server's loop -------------------------------------

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        runner = web.AppRunner(
            make_app(self.model, faults=self.faults, stats=self.stats),
            handle_signals=False,
            access_log=None,
            shutdown_timeout=self._shutdown_timeout,
        )
        await runner.setup()
        handler_factory = runner.server

        def protocol() -> asyncio.Protocol:
            if self.faults._take_refusal():
                self.stats.connections_refused += 1
                return _Refused()
            return handler_factory()

        self._server = await loop.create_server(protocol, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._runner = runner

    async def _close(self) -> None:
        server, runner = self._server, self._runner
        self._server = self._runner = None
        if server is not None:
            server.close()  # stop accepting: new connections are refused from here on
        if runner is not None:
            await runner.cleanup()  # in-flight requests get shutdown_timeout to finish
        if server is not None:
            await server.wait_closed()

    async def arestart(self, downtime: float = 0.0) -> None:
        """Async mode: stop listening, stay down ``downtime`` seconds, listen again on the same port.

        While down, connections are refused by the OS (``ECONNREFUSED``).
        """
        await self._close()
        await asyncio.sleep(downtime)
        await self._listen()

    # -- async mode: the current loop ----------------------------------------

    async def __aenter__(self) -> LoopbackServer:
        if self._server is not None or self._thread is not None:
            raise RuntimeError("LoopbackServer is already running")
        await self._listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    # -- thread mode: its own loop in a background thread --------------------

    def start(self) -> LoopbackServer:
        """Thread mode: start the server on its own loop in a daemon thread; returns once it listens."""
        if self._server is not None or self._thread is not None:
            raise RuntimeError("LoopbackServer is already running")
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="torch_r3-loopback", daemon=True)
        self._thread.start()
        self._loop = loop
        try:
            asyncio.run_coroutine_threadsafe(self._listen(), loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Thread mode: stop the server and its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(timeout=30)
            # Handlers still stalled past shutdown_timeout (an injected stall) would
            # be destroyed pending with the loop: cancel them and let them unwind.
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()
            self._loop = self._thread = None

    def restart(self, downtime: float = 0.0) -> None:
        """Thread mode: like :meth:`arestart`, blocking the caller until the server is back."""
        if self._loop is None:
            raise RuntimeError("restart() is for thread mode (with LoopbackServer()); use await arestart() in async mode")
        asyncio.run_coroutine_threadsafe(self.arestart(downtime), self._loop).result(timeout=60 + downtime)

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
