"""The generate APIs of the inference servers, one small module per server.

- `torch_r3.rollout.protocols.native`: torch_r3's own server format (`POST /v1/generate`);
  `torch_r3.rollout.protocols.torch_r3` is its deprecated name.
- `torch_r3.rollout.protocols.sglang`: SGLang's native `POST /generate`.
- `torch_r3.rollout.protocols.vllm`: vLLM's native `POST /inference/v1/generate`.
- `torch_r3.rollout.protocols.megatron`: Megatron-core's inference server `POST /v1/completions`.
- `torch_r3.rollout.protocols.skyrl`: SkyRL's `POST /skyrl/v1/generate`.
- `torch_r3.rollout.protocols.vllm_openai`: vLLM's OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.
- `torch_r3.rollout.protocols.sglang_openai`: SGLang's OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.
- `torch_r3.rollout.protocols.chat`: the contract of the chat endpoints (`CHATS`), whose
  answers are keyed by the prompt the server's chat template rendered.

Each module holds its server's endpoint paths (their one home) and a stateless
`ServerProtocol` object, `PROTOCOL`, that builds request bodies and reads
answers into the same canonical `ParsedResponse`. `RemoteGenerateClient` picks
one by name from `PROTOCOLS`. `torch_r3.rollout.protocols.spans` reads a body with its
route text left in place, where each protocol's `route_text_paths` says. Nothing
here imports aiohttp.
"""

from __future__ import annotations

from torch_r3.rollout.protocols import megatron, native, sglang, sglang_openai, skyrl, vllm, vllm_openai
from torch_r3.rollout.protocols.base import GenerateCall, ParsedResponse, RouteLimits, ServerProtocol
from torch_r3.rollout.protocols.chat import ChatProtocol
from torch_r3.rollout.protocols.fields import WeightVersionSpan

# The registry (`PROTOCOLS`, `SERVERS`) serves the client, which users reach by
# `server=` name; the public part is the contract each protocol implements.
__all__ = [
    "ChatProtocol",
    "GenerateCall",
    "ParsedResponse",
    "RouteLimits",
    "ServerProtocol",
    "WeightVersionSpan",
]

#: Protocol by `server=` name.
PROTOCOLS: dict[str, ServerProtocol] = {
    p.name: p
    for p in (
        native.PROTOCOL,
        sglang.PROTOCOL,
        vllm.PROTOCOL,
        vllm_openai.PROTOCOL,
        sglang_openai.PROTOCOL,
        megatron.PROTOCOL,
        skyrl.PROTOCOL,
    )
}
#: Chat-completions protocol by `server=` name (`RemoteGenerateClient.chat`).
CHATS: dict[str, ChatProtocol] = {c.name: c for c in (vllm_openai.CHAT, sglang_openai.CHAT)}
#: The `server=` names, in a stable order.
SERVERS = tuple(PROTOCOLS)
