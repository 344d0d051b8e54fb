"""SkyRL's own vLLM endpoint, `POST /skyrl/v1/generate` (SkyRL 0.4).

SkyRL's vLLM server actor serves it next to vLLM's routes. Request:
`{"token_ids": [...], "sampling_params": {...vLLM SamplingParams fields,
"routed_experts_prompt_start"?: s}, "cache_salt"?: salt, "model"?: name}`
(`model` picks a loaded LoRA adapter). Answer: `choices[0]` with `token_ids`,
a string `finish_reason`, `logprobs` as `{"content": [{"logprob": x}, ...]}`
(one per token; SkyRL floors a missing or non-finite one to -9999.0) and
`routed_experts`: the envelope `{"data": base64, "shape": [rows, layers, topk],
"dtype": "uint8" | "int16" | "int32"}`, already compacted (the torch_r3
envelope), or `null` when the server runs without routes. SkyRL turns routes
on with `enable_return_routed_experts` (which needs `moe_enable_routing_replay`)
and vLLM's `--enable-return-routed-experts`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_r3.rollout.protocols._choices import ContentLogprobsProtocol, envelope_routes
from torch_r3.rollout.protocols.base import GenerateCall, RouteLimits
from torch_r3.rollout.protocols.switches import missing_routes_hint

# Reached by `RemoteGenerateClient(server="skyrl")`.
__all__: list[str] = []

GENERATE_PATH = "/skyrl/v1/generate"


class SkyRLProtocol(ContentLogprobsProtocol):
    """SkyRL's `/skyrl/v1/generate` (see the module docstring)."""

    name = "skyrl"
    generate_path = GENERATE_PATH
    null_routes_hint = f" ({missing_routes_hint('skyrl')})"
    check_logprob_ids = False
    route_text_paths = (("choices", "*", "routed_experts", "data"),)  # inside the envelope

    def flags(self, call: GenerateCall) -> dict[str, Any]:
        return {}  # no per-request switch: a server with routes on returns them for every request

    def decode(self, payload: Any, limits: RouteLimits) -> np.ndarray:
        return envelope_routes(payload, limits)


PROTOCOL = SkyRLProtocol()
