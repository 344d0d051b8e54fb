"""A real aiohttp server on 127.0.0.1 for the client tests: handlers a test writes itself, or answers it recorded."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiohttp import web

from torch_r3 import RemoteGenerateClient
from torch_r3.rollout.transport import TransportConfig

TRANSPORT_OPTIONS = frozenset(f.name for f in dataclasses.fields(TransportConfig))


def client_kwargs_of(kwargs: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """Client keywords with the transport options among them (over `defaults`) as one `transport_config=`."""
    options = {**defaults, **{k: v for k, v in kwargs.items() if k in TRANSPORT_OPTIONS}}
    rest = {k: v for k, v in kwargs.items() if k not in TRANSPORT_OPTIONS}
    return {**rest, "transport_config": TransportConfig(**options)}


async def serve_routes(routes: Iterable[tuple[str, str, Any]]) -> tuple[web.AppRunner, str]:
    """Serve `(method, path, handler)` triples on a free port; returns `(runner, base_url)`."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def ask(
    server: str,
    path: str,
    answers: Sequence[Any],
    call: Callable[[RemoteGenerateClient], Awaitable[Any]],
    **client_kwargs: Any,
) -> tuple[Any, list[Any]]:
    """Answer `POST path` with `answers` in turn (the last one again once they run out) and run `call(client)`.

    The client is `RemoteGenerateClient(url, server=server, retries=0, timeout=10.0, **client_kwargs)`.
    Returns what `call` returned and the JSON bodies the server received, in order.
    """
    if not answers:
        raise ValueError("ask() needs at least one answer")
    seen: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(answers[min(len(seen), len(answers)) - 1])

    async def main() -> Any:
        runner, url = await serve_routes([("POST", path, handler)])
        try:
            kwargs = client_kwargs_of(client_kwargs, retries=0, timeout=10.0)
            async with RemoteGenerateClient(url, server=server, **kwargs) as client:
                return await call(client)
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen
