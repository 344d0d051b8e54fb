"""A real aiohttp server on 127.0.0.1 for the client tests: handlers a test writes itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web


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
