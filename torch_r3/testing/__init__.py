"""A real inference server on loopback, for tests and examples.

``torch_r3.testing`` serves ``POST /v1/generate`` (DESIGN.md's wire format) from
a tiny mixture-of-experts language model in pure PyTorch, with genuine routes
captured from its routers, and injects faults on demand. Any model that
implements :class:`ServedModel` can be served the same way.

Example:
    >>> import asyncio
    >>> from torch_r3.client import RemoteGenerateClient
    >>> from torch_r3.testing import LoopbackServer
    >>> with LoopbackServer() as server:
    ...     async def main():
    ...         async with RemoteGenerateClient(server.url) as client:
    ...             return await client.generate([5, 6, 7], {"max_new_tokens": 3}, return_routed_experts=True)
    ...     result = asyncio.run(main())
    >>> len(result.response_ids), result.routed_experts.shape
    (3, (5, 2, 2))

This package imports aiohttp; ``import torch_r3`` does not.
"""

from torch_r3.testing.model import GenerateOutput, ServedModel, TinyMoELM
from torch_r3.testing.server import Faults, LoopbackServer, ServerStats, make_app

__all__ = ["Faults", "GenerateOutput", "LoopbackServer", "ServedModel", "ServerStats", "TinyMoELM", "make_app"]
