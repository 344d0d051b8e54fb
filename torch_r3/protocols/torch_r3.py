"""The torch_r3 server format: `POST /v1/generate` with a route envelope per choice.

Request: `{"token_ids": [...], "sampling_params": {...}, "return_routed_experts":
bool, "model"?: str, "cache_salt"?: str}`, where `sampling_params` carries
`routed_experts_prompt_start` (the first position whose route is wanted) when
routes are asked for from a position past 0.

Answer: `{"choices": [{"token_ids", "finish_reason", "logprobs",
"routed_experts"}], "weight_version"?}`: `finish_reason` a string, `logprobs` a
list of numbers (one per token) or `null`, `routed_experts` the envelope of
`torch_r3.encode_routes` or `null`, `weight_version` the server's string.
"""

from __future__ import annotations

from typing import Any

from torch_r3.codec import WireFormatError, decode_routes
from torch_r3.protocols.base import (
    GenerateCall,
    ParsedResponse,
    RouteLimits,
    ServerProtocol,
    finish_reason,
    get_field,
    logprob,
    slice_to_start,
    token_ids,
    weight_version,
)

__all__ = ["GENERATE_PATH", "MODEL_INFO_PATH", "PROTOCOL", "TorchR3Protocol"]

GENERATE_PATH = "/v1/generate"
MODEL_INFO_PATH = "/v1/model_info"
START_FIELD = "routed_experts_prompt_start"


class TorchR3Protocol(ServerProtocol):
    """The torch_r3 server's own format (see the module docstring)."""

    name = "torch_r3"
    generate_path = GENERATE_PATH
    salt_field = "cache_salt"

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        params = dict(call.sampling_params)
        if START_FIELD in params:
            raise ValueError(f"pass {START_FIELD} as the keyword argument, not inside sampling_params")
        if call.start:
            params[START_FIELD] = call.start
        body: dict[str, Any] = {
            "token_ids": call.prompt,
            "sampling_params": params,
            "return_routed_experts": call.return_routed_experts,
        }
        if call.model is not None:
            body["model"] = call.model
        return self.salted(body, call)

    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        choices = get_field(raw, "choices", "response", list)
        if not choices:
            raise WireFormatError("response.choices is empty")
        choice = choices[0]
        ids = token_ids(get_field(choice, "token_ids", "choices[0]", list), "choices[0].token_ids")
        logprobs = get_field(choice, "logprobs", "choices[0]", list, required=False)
        if logprobs is not None:
            if len(logprobs) != len(ids):
                raise WireFormatError(f"choices[0].logprobs has {len(logprobs)} entries for {len(ids)} tokens")
            logprobs = tuple(logprob(x, f"choices[0].logprobs[{i}]") for i, x in enumerate(logprobs))
        reason = finish_reason(get_field(choice, "finish_reason", "choices[0]", str, required=False), "choices[0].finish_reason")
        routes = None
        if call.return_routed_experts:
            envelope = choice.get("routed_experts")
            if envelope is None and reason == "abort" and not ids:
                pass  # aborted before any forward pass: nothing to replay
            elif envelope is None:
                raise WireFormatError("routes were requested but choices[0].routed_experts is null or missing")
            else:
                routes = decode_routes(
                    envelope, name="choices[0].routed_experts", max_bytes=limits.max_bytes,
                    num_layers=limits.num_layers, topk=limits.topk, num_experts=limits.num_experts,
                )
                routes = slice_to_start(routes, call, len(ids), "choices[0].routed_experts", start_may_be_ignored=False)
        version = weight_version(raw.get("weight_version"), "response.weight_version")
        return ParsedResponse(ids, logprobs, reason, routes, version)


PROTOCOL = TorchR3Protocol()
