"""An `aiohttp.web` inference server on loopback, with fault injection.

It serves one protocol (our own `POST /v1/generate`, SGLang's `POST /generate`
or vLLM's `POST /inference/v1/generate`, one module each in `_wire`) from a
`ServedModel`, returning the genuine routes of every position the model
evaluated from the requested start on, through a prefix cache that keeps routes
with its blocks as the real servers do. Tests run it in-process on
`127.0.0.1`: nothing is mocked at the HTTP layer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from torch_r3._extras import require

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python 3.11+, and the package supports 3.10

require("aiohttp", "testing")  # without aiohttp: name the extra that installs it
from aiohttp import web

from torch_r3._checks import check_bool, check_finite_float, check_int, check_positive
from torch_r3.rollout.protocols.native import MODEL_INFO_PATH
from torch_r3.testing._engine import Engine, ModelOutputError, PrefixCache
from torch_r3.testing._wire import WireProtocol, make_protocol
from torch_r3.testing.faults import Faults
from torch_r3.testing.model import ServedModel, TinyMoELM

__all__ = ["LoopbackServer", "ServerStats"]  # `make_app` builds the application `LoopbackServer` runs


@dataclass
class ServerStats:
    """What the server saw, counted server-side (read it after the requests finish).

    Attributes:
        connections_refused: TCP connections reset by `Faults.refuse_connections`.
        requests: Requests that reached the generate handler (faulted ones included).
        generations: Requests answered `200` with a generation (including the
            `disconnect`/`truncate`/`malformed`/`abort` faults).
        route_rows: Route rows put on the wire, over all generations.
        route_bytes: Decoded route bytes put on the wire (rows * layers * topk * itemsize).
        cached_tokens: Prompt positions served from the prefix cache, over all generations.
        session_ids: The `X-Session-ID` of every generation, in order (`None` when absent).
        in_flight: Requests inside the handler right now.
        max_in_flight: The most requests that were inside the handler at once.
    """

    connections_refused: int = 0
    requests: int = 0
    generations: int = 0
    route_rows: int = 0
    route_bytes: int = 0
    cached_tokens: int = 0
    session_ids: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def make_app(
    model: ServedModel | Engine,
    *,
    protocol: str | WireProtocol = "torch_r3",
    faults: Faults | None = None,
    stats: ServerStats | None = None,
) -> web.Application:
    """The `aiohttp.web` application serving `protocol` from `model`.

    Our own protocol also answers `GET /v1/model_info` with the model's
    `num_layers`, `num_experts`, `topk` and `moe_layers` (the ids of its MoE
    layers); SGLang's answers `POST /flush_cache` and vLLM's
    `POST /reset_prefix_cache`, which drop the prefix cache.

    Args:
        model: The `ServedModel` to generate with (behind a prefix cache with
            the protocol's block size), or an `Engine` to use as it is.
        protocol: `"torch_r3"`, `"sglang"`, `"vllm"`, `"vllm-openai"`, `"sglang-openai"`, `"megatron"`,
            `"skyrl"` or a `WireProtocol`. The two OpenAI-compatible ones also serve
            `POST /v1/chat/completions`, rendering the messages into the model's
            token ids with a chat template of their own (`vocab_size` models only).
        faults: Faults to inject (none when `None`).
        stats: Counters to update (a private one when `None`).

    Returns:
        An application to run with `aiohttp.web.AppRunner` (or use
        `LoopbackServer`, which does it for you).
    """
    wire = make_protocol(protocol)
    # Engine refuses anything that does not implement ServedModel.
    engine = model if isinstance(model, Engine) else Engine(model, PrefixCache(wire.default_block_size))
    handlers = _Handlers(
        wire, engine, faults if faults is not None else Faults(), stats if stats is not None else ServerStats()
    )
    app = web.Application()
    app.router.add_post(wire.generate_path, handlers.generate)
    if wire.chat_path:
        app.router.add_post(wire.chat_path, handlers.chat)
    if wire.name == "torch_r3":
        app.router.add_get(MODEL_INFO_PATH, handlers.model_info)
    if wire.flush_cache_path:
        app.router.add_post(wire.flush_cache_path, handlers.flush_cache)
    return app


class _Handlers:
    """The routes of one application: each request counted, faulted, parsed, generated, rendered, sent."""

    def __init__(self, wire: WireProtocol, engine: Engine, faults: Faults, stats: ServerStats) -> None:
        self.wire, self.engine, self.faults, self.stats = wire, engine, faults, stats
        self.served = engine.model

    def error(self, status: int, message: str) -> web.Response:
        return web.json_response(self.wire.error(status, message), status=status)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, self.wire.parse, self.wire.render)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, self.wire.parse_chat, self.wire.render_chat)

    async def model_info(self, request: web.Request) -> web.Response:
        # What a trainer checks before replaying these routes in its own model.
        served = self.served
        moe_layers = [i for i, moe in enumerate(served.moe_layer_pattern) if moe]
        info = {"num_layers": served.num_layers, "num_experts": served.num_experts, "topk": served.topk}
        return web.json_response({**info, "moe_layers": moe_layers})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.engine.flush_cache()
        return web.Response(text="Cache flushed.")

    async def _counted(self, request: web.Request, parse: Any, render: Any) -> web.StreamResponse:
        stats = self.stats
        stats.requests += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            return await self._generate(request, parse, render)
        finally:
            stats.in_flight -= 1

    async def _generate(self, request: web.Request, parse: Any, render: Any) -> web.StreamResponse:
        fault = self.faults.next_fault()
        kind, args = fault if fault else (None, {})
        if kind == "stall":
            await asyncio.sleep(args["seconds"])
        elif kind == "status":
            if args["json_error"]:
                return self.error(args["code"], args["message"])
            return web.Response(text=args["message"], status=args["code"], content_type="text/plain")
        try:
            body = await request.json()
        except ValueError as exc:
            return self.error(400, f"request body is not JSON: {exc}")
        try:
            parsed = parse(body, self.served)
            samples = parsed.options.get("samples", 1)
            engine = self.engine
            generations = [engine.aborted() if kind == "abort" else engine.generate(parsed) for _ in range(samples)]
        except ModelOutputError as exc:  # a broken ServedModel, not a client error
            return self.error(500, str(exc))
        except (TypeError, ValueError) as exc:
            return self.error(400, str(exc))
        rendered = [render(parsed, g, self.served, malformed=kind == "malformed") for g in generations]
        # One sample: the server's object; several (SGLang's n > 1): a JSON list of them.
        payload = rendered[0][0] if samples == 1 else [body for body, _ in rendered]
        self._count(request, generations, [rows for _, rows in rendered])
        return await self._send(request, json.dumps(payload).encode(), kind)

    def _count(self, request: web.Request, generations: list[Any], rows: list[Any]) -> None:
        stats = self.stats
        stats.generations += 1
        stats.session_ids.append(request.headers.get("X-Session-ID"))
        for generation, routes in zip(generations, rows):
            stats.cached_tokens += generation.cached_tokens
            if routes is not None:
                stats.route_rows += routes.shape[0]
                stats.route_bytes += routes.nbytes

    @staticmethod
    async def _send(request: web.Request, text: bytes, kind: str | None) -> web.StreamResponse:
        """The answer as sent: whole, or cut by a `truncate` or `disconnect` fault."""
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
    cast(asyncio.Transport, transport).abort()  # a TCP transport: it has abort()


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _reset(transport)


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class LoopbackServer:
    """The test server on `127.0.0.1`, in-process, on a free port.

    Use `with` from synchronous code (the server runs its own event loop in a
    background thread) or `async with` from a coroutine (it runs on the
    current loop).

    Requests run through a prefix cache that stores routes with its blocks, as
    vLLM's and SGLang's captures do: a request whose prompt starts with cached
    blocks gets, for those positions, the routes recorded when the blocks were
    computed. After `update_weights` those routes are stale unless the cache is
    flushed or the request carries a salt that keys the cache apart (our
    format and vLLM: `cache_salt`; SGLang: `extra_key`).

    Args:
        model: The model to serve; a seeded `TinyMoELM` by default.
        protocol: `"torch_r3"` (our own format), `"sglang"`, `"vllm"`,
            `"vllm-openai"` (vLLM's `/v1/completions` and `/v1/chat/completions`),
            `"sglang-openai"` (SGLang's), `"megatron"` or `"skyrl"`; the Test
            server page of the API reference lists each one's fields. The chat
            endpoints render messages with a chat template of their own, so the
            server's token ids are not the caller's text.
        faults: Faults to inject; a fresh `Faults` by default (see `faults`).
        host: Address to bind.
        port: Port to bind; `0` picks a free one (see `port`).
        shutdown_timeout: Seconds in-flight requests get to finish on stop or restart.
        routes_enabled: `False` answers like a server launched without its
            routed-experts flag (vLLM: `null` routes; SGLang: no routes key).
        sglang_ignores_start: SGLang only: return every route row from 0 whatever
            `routed_experts_start_len` asked, as sglang 0.5.10.post1 does.
        sglang_indexer: SGLang only: a `torch_r3.testing.indexer.IndexerLM` whose
            real DSA indexers answer `"return_indexer_topk": true` with
            `meta_info.indexer_topk` (as `--enable-return-indexer-topk` does) for
            the prompt and the generated tokens; `None`: the field is never sent.
        sglang_routes_dtype: SGLang only: `"uint8"`/`"uint16"` to narrow the
            routes and announce it in `meta_info.routed_experts_dtype`.
        prefix_cache: Keep a prefix cache (`False`: every route is fresh).
        block_size: Tokens per cache block; the real server's by default
            (vLLM 16, SGLang 1 (its radix tree matches any length), ours 16).
        cache_blocks: Blocks the cache keeps (least recently used evicted first).

    Examples:
        >>> import asyncio
        >>> from torch_r3.rollout.client import RemoteGenerateClient
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
        protocol: str = "torch_r3",
        faults: Faults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 1.0,
        routes_enabled: bool = True,
        sglang_ignores_start: bool = False,
        sglang_routes_dtype: str | None = None,
        sglang_indexer: Any = None,
        prefix_cache: bool = True,
        block_size: int | None = None,
        cache_blocks: int = 4096,
    ) -> None:
        routes_enabled = check_bool(routes_enabled, "routes_enabled")
        sglang_ignores_start = check_bool(sglang_ignores_start, "sglang_ignores_start")
        prefix_cache = check_bool(prefix_cache, "prefix_cache")
        if block_size is not None:
            block_size = check_positive(block_size, "block_size")
        cache_blocks = check_positive(cache_blocks, "cache_blocks")
        port = check_int(port, "port")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0: any free port), got {port}")
        shutdown_timeout = check_finite_float(shutdown_timeout, "shutdown_timeout")
        self.model = model if model is not None else TinyMoELM()
        options: dict[str, Any] = {"routes_enabled": routes_enabled}
        if protocol == "sglang":
            options.update(ignores_start=sglang_ignores_start, routes_dtype=sglang_routes_dtype, indexer=sglang_indexer)
        elif sglang_ignores_start or sglang_routes_dtype is not None or sglang_indexer is not None:
            raise ValueError(
                "sglang_ignores_start, sglang_routes_dtype and sglang_indexer apply to protocol='sglang', "
                f"not {protocol!r}"
            )
        self.wire = make_protocol(protocol, **options)
        if block_size is None:
            block_size = self.wire.default_block_size
        cache = PrefixCache(block_size, cache_blocks) if prefix_cache else None
        self.engine = Engine(self.model, cache)
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
        """`http://host:port`, the client's `base_url`."""
        return f"http://{self.host}:{self.port}"

    @property
    def protocol(self) -> str:
        """The protocol served, as `protocol=` named it."""
        return self.wire.name

    @property
    def weight_version(self) -> str:
        """The weight version requests run with now (`"0"` until the first `update_weights`)."""
        return self.engine.weight_version

    def update_weights(self, *, weight_version: str | None = None, flush_cache: bool | None = None) -> str:
        """Load new weights into the model (`ServedModel.update_weights`) and bump the weight version.

        Safe to call from any thread while the server runs: requests already
        generating finish with the old weights, later ones use the new.

        Args:
            weight_version: The new version's name; the number of updates so
                far (`"1"`, `"2"`, ...) by default.
            flush_cache: Drop the prefix cache too. By default `True` for
                SGLang (its weight-update endpoints flush the radix cache unless
                told not to) and `False` for vLLM and our format (vLLM keeps its
                prefix cache until `/reset_prefix_cache`).

        Returns:
            The new weight version.

        Examples:
            >>> server = LoopbackServer(protocol="vllm")
            >>> server.update_weights(), server.weight_version
            ('1', '1')
        """
        if flush_cache is None:
            flush_cache = self.wire.name in ("sglang", "sglang-openai")
        return self.engine.update_weights(weight_version=weight_version, flush_cache=flush_cache)

    def flush_cache(self) -> None:
        """Drop the prefix cache (what SGLang's `/flush_cache` and vLLM's `/reset_prefix_cache` do)."""
        self.engine.flush_cache()

    # -- listening, on the server's loop -------------------------------------

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        runner = web.AppRunner(
            make_app(self.engine, protocol=self.wire, faults=self.faults, stats=self.stats),
            handle_signals=False,
            access_log=None,
            shutdown_timeout=self._shutdown_timeout,
        )
        await runner.setup()
        handler_factory = runner.server
        assert handler_factory is not None  # set by setup()

        def protocol() -> asyncio.Protocol:
            if self.faults.take_refusal():
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
        """Async mode: stop listening, stay down `downtime` seconds, listen again on the same port.

        While down, connections are refused by the OS (`ECONNREFUSED`). The
        prefix cache starts empty again, as a restarted server's does; the
        weights and their version stay.
        """
        await self._close()
        self.engine.flush_cache()
        await asyncio.sleep(downtime)
        await self._listen()

    # -- async mode: the current loop ----------------------------------------

    async def __aenter__(self) -> Self:
        if self._server is not None or self._thread is not None:
            raise RuntimeError("LoopbackServer is already running")
        await self._listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    # -- thread mode: its own loop in a background thread --------------------

    def start(self) -> Self:
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
        """Thread mode: like `arestart`, blocking the caller until the server is back."""
        if self._loop is None:
            raise RuntimeError(
                "restart() is for thread mode (with LoopbackServer()); use await arestart() in async mode"
            )
        asyncio.run_coroutine_threadsafe(self.arestart(downtime), self._loop).result(timeout=60 + downtime)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
