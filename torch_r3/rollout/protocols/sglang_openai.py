"""SGLang's OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions` (sglang 0.5.23).

Both take OpenAI's sampling fields at the top level (`max_tokens`,
`temperature`, ...) plus SGLang's own: `return_routed_experts: true`,
`routed_experts_start_len` (the first position whose row is wanted),
`return_token_ids: true` and `cache_salt` (SGLang's cache namespace, which
keeps otherwise identical prefixes apart). A server started with
`--enable-return-routed-experts` answers with the routes of the first result
in the **response-level** `sglext.routed_experts`: base64 of the flat
little-endian `int32` rows `[rows, num_hidden_layers, topk]`, no header, the
same text as `meta_info.routed_experts` of the native `/generate` (so the
client must be given `num_layers` and `topk`). Non-streaming answers only.
The weight version is the response-level `metadata.weight_version`, with
`metadata.weight_versions` spans over the generated tokens.

- Completions (`server="sglang-openai"`, `RemoteGenerateClient.generate`): the
  prompt is sent as token ids (`prompt: [...]`) with `logprobs: 0` (the
  sampled token's log-prob); `choices[0]` carries `token_ids`,
  `prompt_token_ids` (with `return_token_ids`) and `logprobs.token_logprobs`.
- Chat (`RemoteGenerateClient.chat`): the server renders the messages with its
  chat template, so the rows describe the server's tokens. `return_token_ids`
  makes `choices[0]` carry `prompt_token_ids` (the rendered prompt: key the
  trace by them) and `response_token_ids`; log-probs are in
  `choices[0].logprobs.content[i].logprob`. The client does not send
  `return_meta_info`: with it, SGLang moves the routes out of `sglext`.

SGLang writes a -inf or NaN log-prob as `null`; it is read as NaN. An answer
without the token ids (an SGLang that predates `return_token_ids` on these
endpoints) is refused: its rows cannot be matched to tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols import _openai, fields
from torch_r3.rollout.protocols._openai import CompletionsProtocol, generated_ids, rendered_prompt
from torch_r3.rollout.protocols.base import GenerateCall, ParsedResponse, RouteLimits
from torch_r3.rollout.protocols.chat import ChatProtocol
from torch_r3.rollout.protocols.sglang import sliced_routes
from torch_r3.rollout.protocols.switches import missing_routes_hint

# Reached by `RemoteGenerateClient(server="sglang-openai")`.
__all__: list[str] = []

# This server's endpoints, under the names the module has always had.
COMPLETIONS_PATH, CHAT_PATH = _openai.COMPLETIONS_PATH, _openai.CHAT_PATH

_ROUTES = ("sglext", "routed_experts")
# The fields the client sets itself (return_meta_info would move the routes out of sglext).
_OWN_FIELDS = (
    *_openai.OWN_FIELDS,
    "return_prompt_token_ids",
    "return_routed_experts",
    "routed_experts_start_len",
    "return_meta_info",
    "cache_salt",
    "extra_key",
)
_TOO_OLD = "an SGLang too old for return_token_ids on its OpenAI endpoints? use server='sglang' (/generate) instead"


def _body(params: Mapping[str, Any], want_routes: bool, start: int, model: str | None) -> dict[str, Any]:
    body = _openai.top_level(params, _OWN_FIELDS, model)
    if want_routes:
        body["return_routed_experts"] = True
        if start:
            body["routed_experts_start_len"] = start
    return body


def _parsed(read: _openai.ReadChoice, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
    raw, _, ids, logprobs, reason = read
    routes = None
    if call.return_routed_experts:
        ext = fields.get_field(raw, "sglext", "response", dict, required=False)
        payload = None if ext is None else ext.get("routed_experts")
        if payload is None and (reason == "abort" or not ids):
            reason = "abort"  # aborted: SGLang sends no routes
        elif payload is None:
            raise WireFormatError(
                f"routes were requested but sglext.routed_experts is missing ({missing_routes_hint('sglang')})"
            )
        else:
            if limits.num_layers is None or limits.topk is None:  # the client checks this before sending
                raise ValueError("server='sglang-openai' needs num_layers= and topk= to read routes")
            routes = sliced_routes(
                payload, call, len(ids), limits, (limits.num_layers, limits.topk), "sglext.routed_experts", "int32"
            )
    meta = fields.get_field(raw, "metadata", "response", dict, required=False) or {}
    version = fields.weight_version(meta.get("weight_version"), "metadata.weight_version")
    spans = fields.weight_spans(meta.get("weight_versions"), "metadata.weight_versions", len(ids))
    return ParsedResponse(ids, logprobs, reason, routes, fields.newest_version(version, spans), spans)


class SGLangCompletionsProtocol(CompletionsProtocol):
    """SGLang's `/v1/completions` with a token-id prompt (see the module docstring)."""

    name = "sglang-openai"
    needs_route_shape = True
    route_payload_paths = (_ROUTES,)
    route_text_paths = (_ROUTES,)
    sampled_logprobs = 0
    top_level = staticmethod(_body)
    parsed = staticmethod(_parsed)
    too_old = _TOO_OLD


class SGLangChatProtocol(ChatProtocol):
    """SGLang's `/v1/chat/completions` (see the module docstring); used by `RemoteGenerateClient.chat`."""

    name = "sglang-openai"
    path = CHAT_PATH
    route_payload_paths = (_ROUTES,)
    route_text_paths = (_ROUTES,)
    top_level = staticmethod(_body)

    def parse_response(
        self, raw: Any, *, return_routed_experts: bool, start: int, limits: RouteLimits
    ) -> tuple[tuple[int, ...], ParsedResponse]:
        choice = fields.first_choice(raw)
        prompt = rendered_prompt(
            fields.get_field(choice, "prompt_token_ids", "choices[0]", list, required=False),
            "choices[0].prompt_token_ids",
            start,
            "routed_experts_start_len",
            _TOO_OLD,
        )
        ids = generated_ids(choice, "response_token_ids", _TOO_OLD)
        logprobs = fields.chat_logprobs(choice, len(ids), null_is_nan=True)
        call = GenerateCall(list(prompt), {}, return_routed_experts, start)
        return prompt, _parsed(_openai.read_choice(raw, choice, ids, logprobs), call, limits)


PROTOCOL = SGLangCompletionsProtocol()
CHAT = SGLangChatProtocol()
