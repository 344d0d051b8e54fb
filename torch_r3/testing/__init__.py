"""A real inference server on loopback, for tests and examples.

`torch_r3.testing` serves a tiny mixture-of-experts language model in pure
PyTorch over HTTP, in the format of our own `POST /v1/generate`, SGLang's
`POST /generate` or vLLM's `POST /inference/v1/generate`, with genuine routes
captured from its routers over every hidden layer (zero rows for dense
layers), a prefix cache that keeps routes with its blocks, weight updates that
bump a weight version, and faults injected on demand. Any model that
implements `ServedModel` can be served the same way.

Examples:
    >>> import asyncio
    >>> from torch_r3.rollout.client import RemoteGenerateClient
    >>> from torch_r3.testing import LoopbackServer
    >>> with LoopbackServer() as server:
    ...     async def main():
    ...         async with RemoteGenerateClient(server.url) as client:
    ...             return await client.generate([5, 6, 7], {"max_new_tokens": 3}, return_routed_experts=True)
    ...     result = asyncio.run(main())
    >>> len(result.response_ids), result.routed_experts.shape
    (3, (5, 2, 2))

This package imports aiohttp; `import torch_r3` does not.

The front is small, as `numpy.testing`'s is: the server, the model it serves or
the interface to serve your own, and the faults and counters a test reads. The
engine, its prefix cache and the per-protocol wire code are machinery
(`_engine`, `_wire`).
"""

from torch_r3.testing.faults import Faults
from torch_r3.testing.model import GenerateOutput, ServedModel, TinyMoELM
from torch_r3.testing.server import LoopbackServer, ServerStats

__all__ = ["Faults", "GenerateOutput", "LoopbackServer", "ServedModel", "ServerStats", "TinyMoELM"]
