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

from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols import _openai, fields
from torch_r3.rollout.protocols._choices import npy_routes
from torch_r3.rollout.protocols._openai import CompletionsProtocol, generated_ids, rendered_prompt
from torch_r3.rollout.protocols.base import GenerateCall, ParsedResponse, RouteLimits
from torch_r3.rollout.protocols.chat import ChatProtocol
from torch_r3.rollout.protocols.switches import missing_routes_hint

# Reached by `RemoteGenerateClient(server="vllm-openai")`.
__all__: list[str] = []

# This server's endpoints, under the names the module has always had.
COMPLETIONS_PATH, CHAT_PATH = _openai.COMPLETIONS_PATH, _openai.CHAT_PATH

# The fields the client sets itself: the caller's sampling parameters must not hold them.
_OWN_FIELDS = (
    *_openai.OWN_FIELDS,
    "return_weight_versions",
    "cache_salt",
    fields.PROMPT_START_PARAM,
)


def _body(params: Mapping[str, Any], want_routes: bool, start: int, model: str | None) -> dict[str, Any]:
    body = _openai.top_level(params, _OWN_FIELDS, model)
    body["return_weight_versions"] = True
    if want_routes and start:
        body[fields.PROMPT_START_PARAM] = start
    return body


def _parsed(read: _openai.ReadChoice, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
    _, choice, ids, logprobs, reason = read
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
            decoded = npy_routes(payload, limits)
            routes = fields.slice_to_start(
                decoded, call, len(ids), "choices[0].routed_experts", start_may_be_ignored=True
            )
    spans = fields.weight_spans(choice.get("weight_versions"), "choices[0].weight_versions", len(ids))
    return ParsedResponse(ids, logprobs, reason, routes, fields.newest_version(None, spans), spans)


class VLLMCompletionsProtocol(CompletionsProtocol):
    """vLLM's `/v1/completions` with a token-id prompt (see the module docstring)."""

    name = "vllm-openai"
    route_payload_paths = (("choices", "*", "routed_experts"),)
    route_text_paths = (("choices", "*", "routed_experts"),)
    sampled_logprobs = 1
    top_level = staticmethod(_body)
    parsed = staticmethod(_parsed)
    too_old = "a vLLM too old for this endpoint?"

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        body = super().request_body(call)
        # The log-prob block names each token: as text, vLLM needs a tokenizer, and a server
        # started with --skip-tokenizer-init refuses the request (HTTP 400). By id it needs
        # none; the client reads only the numbers.
        body.setdefault("return_tokens_as_token_ids", True)
        return body


class VLLMChatProtocol(ChatProtocol):
    """vLLM's `/v1/chat/completions` (see the module docstring); used by `RemoteGenerateClient.chat`."""

    name = "vllm-openai"
    path = CHAT_PATH
    route_payload_paths = VLLMCompletionsProtocol.route_payload_paths
    route_text_paths = VLLMCompletionsProtocol.route_text_paths
    top_level = staticmethod(_body)

    def parse_response(
        self, raw: Any, *, return_routed_experts: bool, start: int, limits: RouteLimits
    ) -> tuple[tuple[int, ...], ParsedResponse]:
        """The server's rendered prompt ids and the parsed first choice.

        Raises:
            WireFormatError: The answer lacks `prompt_token_ids` (without them
                the rows cannot be matched to tokens), breaks the format, or
                `start` is past the rendered prompt.
        """
        prompt = rendered_prompt(
            fields.get_field(raw, "prompt_token_ids", "response", list, required=False),
            "response.prompt_token_ids",
            start,
            fields.PROMPT_START_PARAM,
            "a server that ignores it is too old: send token ids to /v1/completions, server='vllm-openai', instead",
        )
        choice = fields.first_choice(raw)
        ids = generated_ids(choice, "token_ids", VLLMCompletionsProtocol.too_old)
        logprobs = fields.chat_logprobs(choice, len(ids), null_is_nan=False)
        call = GenerateCall(list(prompt), {}, return_routed_experts, start)
        return prompt, _parsed(_openai.read_choice(raw, choice, ids, logprobs), call, limits)


PROTOCOL = VLLMCompletionsProtocol()
CHAT = VLLMChatProtocol()
