"""The torch_r3 server format: `POST /v1/generate` with a route envelope per choice.

Request: `{"token_ids": [...], "sampling_params": {...}, "return_routed_experts":
bool, "model"?: str, "cache_salt"?: str}`, where `sampling_params` carries
`routed_experts_prompt_start` (the first position whose route is wanted) when
routes are asked for from a position past 0. Requests share prefix-cache
entries only with an equal `cache_salt`.

Answer: `{"choices": [{"token_ids", "finish_reason", "logprobs",
"routed_experts"}], "weight_version"?}`: `finish_reason` a string, `logprobs` a
list of numbers (one per token) or `null`, `routed_experts` the envelope of
`torch_r3.encode_routes` or `null`, `weight_version` the server's string.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols import fields
from torch_r3.rollout.protocols._choices import envelope_routes
from torch_r3.rollout.protocols.base import ChoicesProtocol, GenerateCall, RouteLimits

# Reached by `RemoteGenerateClient(server="torch_r3")`: the docstring above is this
# server's format; `TorchR3Protocol`, its paths and `PROTOCOL` serve the client.
__all__: list[str] = []

GENERATE_PATH = "/v1/generate"
MODEL_INFO_PATH = "/v1/model_info"


class TorchR3Protocol(ChoicesProtocol):
    """The torch_r3 server's own format (see the module docstring)."""

    name = "torch_r3"
    generate_path = GENERATE_PATH
    salt_field = "cache_salt"
    route_text_paths = (("choices", "*", "routed_experts", "data"),)  # inside the envelope

    def flags(self, call: GenerateCall) -> dict[str, Any]:
        return {"return_routed_experts": call.return_routed_experts}

    def read_logprobs(self, choice: Mapping[str, Any], ids: tuple[int, ...]) -> tuple[float, ...] | None:
        logprobs = fields.get_field(choice, "logprobs", "choices[0]", list, required=False)
        if logprobs is None:
            return None
        if len(logprobs) != len(ids):
            raise WireFormatError(f"choices[0].logprobs has {len(logprobs)} entries for {len(ids)} tokens")
        return tuple(fields.logprob(x, f"choices[0].logprobs[{i}]") for i, x in enumerate(logprobs))

    def decode(self, payload: Any, limits: RouteLimits) -> np.ndarray:
        return envelope_routes(payload, limits)

    def read_weight_version(self, raw: Mapping[str, Any]) -> str | None:
        return fields.weight_version(raw.get("weight_version"), "response.weight_version")


PROTOCOL = TorchR3Protocol()
