"""The loopback server's protocols, one module each.

`native` (our own, `server="torch_r3"`), `sglang`, `vllm`, `openai` (vLLM's
`/v1/completions` and `/v1/chat/completions`, `server="vllm-openai"`),
`sglang_openai` (SGLang's, `server="sglang-openai"`), `megatron` and `skyrl`;
`chat` is the chat template the two chat endpoints render messages with.

Each module holds a `WireProtocol` subclass that parses its server's request
body and renders the response body that server sends, field for field.
`make_protocol` builds one by name.
"""

from __future__ import annotations

from typing import Any

from torch_r3._checks import check_choice
from torch_r3.testing._wire.base import WireProtocol
from torch_r3.testing._wire.megatron import MegatronWire
from torch_r3.testing._wire.native import TorchR3Wire
from torch_r3.testing._wire.openai import VLLMCompletionsWire
from torch_r3.testing._wire.sglang import SGLangWire
from torch_r3.testing._wire.sglang_openai import SGLangCompletionsWire
from torch_r3.testing._wire.skyrl import SkyRLWire
from torch_r3.testing._wire.vllm import VLLMWire

__all__ = [
    "PROTOCOLS",
    "MegatronWire",
    "SGLangCompletionsWire",
    "SGLangWire",
    "SkyRLWire",
    "TorchR3Wire",
    "VLLMCompletionsWire",
    "VLLMWire",
    "WireProtocol",
    "make_protocol",
]

PROTOCOLS: dict[str, type[WireProtocol]] = {
    cls.name: cls
    for cls in (TorchR3Wire, SGLangWire, VLLMWire, VLLMCompletionsWire, SGLangCompletionsWire, MegatronWire, SkyRLWire)
}


def make_protocol(protocol: str | WireProtocol, **options: Any) -> WireProtocol:
    """`protocol` itself if it is a `WireProtocol`, else the named one built with `options`.

    Examples:
        >>> make_protocol("vllm").generate_path
        '/inference/v1/generate'
    """
    if isinstance(protocol, WireProtocol):
        if options:
            raise ValueError(f"options {sorted(options)} apply to a protocol name, not to a WireProtocol instance")
        return protocol
    check_choice(protocol, "protocol", sorted(PROTOCOLS))
    return PROTOCOLS[protocol](**options)
