"""vLLM's native `POST /inference/v1/generate` (server flag `--enable-return-routed-experts`).

Request: `{"token_ids": [...], "sampling_params": {"max_tokens", "logprobs",
"routed_experts_prompt_start"?: s, ...}, "return_token_ids": true,
"cache_salt"?: salt}`. vLLM has no per-request routes switch: a server started
with the flag returns routes for every request (the client drops them when
they were not asked for). `cache_salt` is top level; vLLM shares prefix-cache
blocks only between requests with the same salt and refuses an empty one.

Answer: `choices[0]` with `token_ids`, `finish_reason` (a string), `logprobs`
(`{"content": [{"token_id", "logprob", ...}]}` or `null`) and `routed_experts`:
base64 of a whole `.npy` file `[rows, num_hidden_layers, topk]` (`uint8` up to
256 experts, else `uint16`; `int32` on older servers), or `null` when the server
runs without the flag or the request was aborted before any forward pass.
vLLM reports no weight version.
"""

from __future__ import annotations

from typing import Any

from torch_r3.codec import WireFormatError, decode_vllm_routes
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
)

__all__ = ["GENERATE_PATH", "PROTOCOL", "RESET_PREFIX_CACHE_PATH", "VLLMProtocol"]

GENERATE_PATH = "/inference/v1/generate"
#: vLLM's endpoint that drops its prefix cache.
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
START_FIELD = "routed_experts_prompt_start"


class VLLMProtocol(ServerProtocol):
    """vLLM's native `/inference/v1/generate` (see the module docstring)."""

    name = "vllm"
    generate_path = GENERATE_PATH
    salt_field = "cache_salt"

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        params = dict(call.sampling_params)
        if START_FIELD in params:
            raise ValueError(f"pass {START_FIELD} as the keyword argument, not inside sampling_params")
        params.setdefault("logprobs", 1)  # the sampled token's logprob, which RL needs
        if call.return_routed_experts and call.start:
            params[START_FIELD] = call.start
        body: dict[str, Any] = {"token_ids": call.prompt, "sampling_params": params, "return_token_ids": True}
        if call.model is not None:
            body["model"] = call.model
        return self.salted(body, call)

    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        choices = get_field(raw, "choices", "response", list)
        if not choices:
            raise WireFormatError("response.choices is empty")
        choice = choices[0]
        ids = token_ids(get_field(choice, "token_ids", "choices[0]", list), "choices[0].token_ids")
        reason = finish_reason(get_field(choice, "finish_reason", "choices[0]", str, required=False), "choices[0].finish_reason")
        logprobs = None
        block = get_field(choice, "logprobs", "choices[0]", dict, required=False)
        if block is not None:
            content = get_field(block, "content", "choices[0].logprobs", list)
            if len(content) != len(ids):
                raise WireFormatError(f"choices[0].logprobs.content has {len(content)} entries for {len(ids)} tokens")
            values = []
            for i, entry in enumerate(content):
                where = f"choices[0].logprobs.content[{i}]"
                if get_field(entry, "token_id", where, int) != ids[i]:
                    raise WireFormatError(f"{where}.token_id {entry['token_id']!r} is not token_ids[{i}] = {ids[i]}")
                values.append(logprob(get_field(entry, "logprob", where, (int, float)), f"{where}.logprob"))
            logprobs = tuple(values)
        routes = None
        if call.return_routed_experts:
            payload = choice.get("routed_experts")
            if payload is None and not ids:
                reason = "abort"  # aborted before any forward pass: vLLM sends null
            elif payload is None:
                raise WireFormatError(
                    "routes were requested but choices[0].routed_experts is null "
                    "(is the server started with --enable-return-routed-experts?)"
                )
            else:
                routes = decode_vllm_routes(
                    payload, num_layers=limits.num_layers if limits.topk is not None else None,
                    topk=limits.topk if limits.num_layers is not None else None,
                    num_experts=limits.num_experts, max_bytes=limits.max_bytes, name="choices[0].routed_experts",
                )
                routes = slice_to_start(routes, call, len(ids), "choices[0].routed_experts", start_may_be_ignored=True)
        return ParsedResponse(ids, logprobs, reason, routes, None)


PROTOCOL = VLLMProtocol()
