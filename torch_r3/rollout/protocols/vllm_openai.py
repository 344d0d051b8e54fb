"""vLLM's OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions` (vLLM 0.22 to 0.34).

Both take the sampling parameters at the top level in OpenAI's names
(`max_tokens`, `temperature`, ...) plus vLLM's own fields:
`return_token_ids: true` (the answer then carries the generated token ids, and
the prompt's), `return_weight_versions: true`, `routed_experts_prompt_start`
(top level here, not in `sampling_params`) and `cache_salt`. A server started
with `--enable-return-routed-experts` puts `routed_experts` in every choice:
base64 of a `.npy` file `[rows, num_hidden_layers, topk]`, as the native endpoint
does; non-streaming answers only.

Releases differ (read off each release's protocol classes): routes arrived in
these answers with 0.22 (0.21 sent nested lists over the MoE layers only, split
into a response-level `prompt_routed_experts` and per-choice generated rows: not
read, refused with a message naming the release); the top-level
`routed_experts_prompt_start` with 0.28 (0.22 to 0.27 ignore the field and send
every row from position 0, which is recognised by its row count and sliced
here); `weight_versions` in the choices with 0.33 (`None` before).

- Completions (`server="vllm-openai"`, `RemoteGenerateClient.generate`): the
  prompt is sent as token ids (`prompt: [...]`); `choices[0]` carries
  `token_ids`, `prompt_token_ids`, `logprobs.token_logprobs` and
  `weight_versions`.
- Chat (`RemoteGenerateClient.chat`): the server renders the messages with its
  chat template, so the positions the routes describe are the server's tokens,
  not the caller's: the answer's top-level `prompt_token_ids` are the rendered
  prompt, and a multi-turn trace must be keyed by them (`RemoteGenerateResult.prompt_token_ids`).
  Log-probs are in `choices[0].logprobs.content[i].logprob`, one per token of
  `choices[0].token_ids`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from torch_r3.rollout.codec import WireFormatError, decode_vllm_routes
from torch_r3.rollout.protocols import fields
from torch_r3.rollout.protocols.base import GenerateCall, ParsedResponse, RouteLimits, ServerProtocol
from torch_r3.rollout.protocols.chat import ChatProtocol
from torch_r3.rollout.protocols.switches import missing_routes_hint

# Reached by `RemoteGenerateClient(server="vllm-openai")`.
__all__: list[str] = []

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# The fields the client sets itself: the caller's sampling parameters must not hold them.
_OWN_FIELDS = (
    "prompt",
    "messages",
    "model",
    "stream",
    "return_token_ids",
    "return_weight_versions",
    "cache_salt",
    fields.PROMPT_START_PARAM,
)


class VLLMCompletionsProtocol(ServerProtocol):
    """vLLM's `/v1/completions` with a token-id prompt (see the module docstring)."""

    name = "vllm-openai"
    generate_path = COMPLETIONS_PATH
    salt_field = "cache_salt"
    route_payload_paths = (("choices", "*", "routed_experts"),)
    route_text_paths = (("choices", "*", "routed_experts"),)

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        body = _body(call.sampling_params, call.return_routed_experts, call.start, call.model)
        body["prompt"] = call.prompt
        body.setdefault("logprobs", 1)  # the sampled token's logprob, which RL needs
        return self.salted(body, call)

    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        choice = fields.first_choice(raw)
        ids = _generated_ids(choice)
        sent_back = fields.get_field(choice, "prompt_token_ids", "choices[0]", list, required=False)
        if sent_back is not None and list(fields.token_ids(sent_back, "choices[0].prompt_token_ids")) != call.prompt:
            raise WireFormatError("choices[0].prompt_token_ids is not the prompt that was sent")
        logprobs = fields.completion_logprobs(choice, len(ids))
        return _parsed(choice, ids, logprobs, call, limits)


class VLLMChatProtocol(ChatProtocol):
    """vLLM's `/v1/chat/completions` (see the module docstring); used by `RemoteGenerateClient.chat`."""

    name = "vllm-openai"
    path = CHAT_PATH
    route_payload_paths = VLLMCompletionsProtocol.route_payload_paths
    route_text_paths = VLLMCompletionsProtocol.route_text_paths

    def request_body(
        self,
        messages: list[dict[str, Any]],
        sampling_params: Mapping[str, Any],
        *,
        return_routed_experts: bool,
        start: int,
        cache_salt: str | None,
        model: str | None,
    ) -> dict[str, Any]:
        """The JSON body; `messages` as given (checked by the client to be a list of objects)."""
        body = _body(sampling_params, return_routed_experts, start, model)
        body["messages"] = messages
        body.setdefault("logprobs", True)
        if cache_salt is not None:
            body["cache_salt"] = fields.check_cache_salt(cache_salt)
        return body

    def parse_response(
        self, raw: Any, *, return_routed_experts: bool, start: int, limits: RouteLimits
    ) -> tuple[tuple[int, ...], ParsedResponse]:
        """The server's rendered prompt ids and the parsed first choice.

        Raises:
            WireFormatError: The answer lacks `prompt_token_ids` (without them
                the rows cannot be matched to tokens), breaks the format, or
                `start` is past the rendered prompt.
        """
        prompt_ids = fields.get_field(raw, "prompt_token_ids", "response", list, required=False)
        if prompt_ids is None:
            raise WireFormatError(
                "response.prompt_token_ids is missing: the server rendered the messages with its chat template and "
                "did not say into which tokens, so routes cannot be matched to positions (the client sends "
                "return_token_ids: true; a server that ignores it is too old: send token ids to /v1/completions, "
                "server='vllm-openai', instead)"
            )
        prompt = fields.token_ids(prompt_ids, "response.prompt_token_ids")
        if start > len(prompt):
            raise WireFormatError(
                f"routed_experts_prompt_start {start} is past the {len(prompt)}-token prompt the server rendered"
            )
        choice = fields.first_choice(raw)
        ids = _generated_ids(choice)
        logprobs = fields.chat_logprobs(choice, len(ids), null_is_nan=False)
        call = GenerateCall(list(prompt), {}, return_routed_experts, start)
        return prompt, _parsed(choice, ids, logprobs, call, limits)


def _body(params: Mapping[str, Any], want_routes: bool, start: int, model: str | None) -> dict[str, Any]:
    for key in _OWN_FIELDS:
        if key in params:
            raise ValueError(f"sampling_params must not hold {key!r}: the client sets it")
    body: dict[str, Any] = dict(params)
    body["return_token_ids"] = True
    body["return_weight_versions"] = True
    if want_routes and start:
        body[fields.PROMPT_START_PARAM] = start
    if model is not None:
        body["model"] = model
    return body


def _generated_ids(choice: Mapping[str, Any]) -> tuple[int, ...]:
    value = fields.get_field(choice, "token_ids", "choices[0]", list, required=False)
    if value is None:
        raise WireFormatError(
            "choices[0].token_ids is missing: the server ignored return_token_ids (a vLLM too old for this endpoint?)"
        )
    return fields.token_ids(value, "choices[0].token_ids")


def _parsed(
    choice: Mapping[str, Any],
    ids: tuple[int, ...],
    logprobs: tuple[float, ...] | None,
    call: GenerateCall,
    limits: RouteLimits,
) -> ParsedResponse:
    reason = fields.finish_reason(
        fields.get_field(choice, "finish_reason", "choices[0]", str, required=False), "choices[0].finish_reason"
    )
    routes = None
    if call.return_routed_experts:
        payload = choice.get("routed_experts")
        if isinstance(payload, list):
            raise WireFormatError(
                "choices[0].routed_experts is a nested list, as vLLM 0.21 sent it (the generated tokens' rows over "
                "the MoE layers only, the prompt's in a response-level prompt_routed_experts); this client reads "
                "the base64 .npy routes of vLLM 0.22 and later: upgrade the server"
            )
        if payload is None and not ids:
            reason = "abort"
        elif payload is None:
            raise WireFormatError(
                f"routes were requested but choices[0].routed_experts is null or missing ({missing_routes_hint('vllm')})"
            )
        else:
            known = limits.num_layers is not None and limits.topk is not None
            decoded: np.ndarray = decode_vllm_routes(
                payload,
                num_layers=limits.num_layers if known else None,
                topk=limits.topk if known else None,
                num_experts=limits.num_experts,
                max_bytes=limits.max_bytes,
                name="choices[0].routed_experts",
            )
            routes = fields.slice_to_start(
                decoded, call, len(ids), "choices[0].routed_experts", start_may_be_ignored=True
            )
    spans = fields.weight_spans(choice.get("weight_versions"), "choices[0].weight_versions", len(ids))
    return ParsedResponse(ids, logprobs, reason, routes, fields.newest_version(None, spans), spans)


PROTOCOL = VLLMCompletionsProtocol()
CHAT = VLLMChatProtocol()
