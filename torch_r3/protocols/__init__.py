"""The generate APIs of the inference servers, one small module per server.

- `torch_r3.protocols.native`: torch_r3's own server format (`POST /v1/generate`);
  `torch_r3.protocols.torch_r3` is its deprecated name.
- `torch_r3.protocols.sglang`: SGLang's native `POST /generate`.
- `torch_r3.protocols.vllm`: vLLM's native `POST /inference/v1/generate`.

Each module holds its server's endpoint paths (their one home) and a stateless
`ServerProtocol` object, `PROTOCOL`, that builds request bodies and reads
answers into the same canonical `ParsedResponse`. `RemoteGenerateClient` picks
one by name from `PROTOCOLS`. `torch_r3.protocols.spans` reads a body with its
route text left in place, where each protocol's `route_text_paths` says. Nothing
here imports aiohttp.
"""

from __future__ import annotations

from torch_r3.protocols import native, sglang, vllm
from torch_r3.protocols.base import GenerateCall, ParsedResponse, RouteLimits, ServerProtocol, WeightVersionSpan

# The registry (`PROTOCOLS`, `SERVERS`) serves the client, which users reach by
# `server=` name; the public part is the contract each protocol implements.
__all__ = [
    "GenerateCall",
    "ParsedResponse",
    "RouteLimits",
    "ServerProtocol",
    "WeightVersionSpan",
]

#: Protocol by `server=` name.
PROTOCOLS: dict[str, ServerProtocol] = {p.name: p for p in (native.PROTOCOL, sglang.PROTOCOL, vllm.PROTOCOL)}
#: The `server=` names, in a stable order.
SERVERS = tuple(PROTOCOLS)
