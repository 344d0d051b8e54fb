"""A real aiohttp server on 127.0.0.1 for the client tests: handlers a test writes itself, or answers it recorded."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiohttp import web

from torch_r3 import RemoteGenerateClient


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
            kwargs = {"retries": 0, "timeout": 10.0, **client_kwargs}
            async with RemoteGenerateClient(url, server=server, **kwargs) as client:
                return await call(client)
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen
