"""What the OpenAI-compatible endpoints of vLLM and SGLang share (`vllm_openai`, `sglang_openai`).

Both servers take a token-id `prompt` on `/v1/completions` with OpenAI's
sampling fields at the top level, answer the generated ids in
`choices[0].token_ids` when asked with `return_token_ids: true`, and may echo
the prompt in `choices[0].prompt_token_ids`. What differs (the route fields,
where the routes and the rendered chat prompt sit) stays in each server's module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols import fields
from torch_r3.rollout.protocols._lists import TOKEN_ID_END, all_token_ids
from torch_r3.rollout.protocols.base import GenerateCall, ParsedResponse, RouteLimits, ServerProtocol

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

# The fields the caller may not set on either server: what the shared requests set (the prompt or
# messages, `model`, `return_token_ids`) and `stream` (the client reads one whole answer).
# Each server's module adds its own fields after these.
OWN_FIELDS = ("prompt", "messages", "model", "stream", "return_token_ids")


class ReadChoice(NamedTuple):
    """An answer's `choices[0]` as both servers read it alike; a server's `parsed` reads the rest."""

    raw: Any
    choice: Mapping[str, Any]
    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    reason: str | None


def read_choice(
    raw: Any, choice: Mapping[str, Any], ids: tuple[int, ...], logprobs: tuple[float, ...] | None
) -> ReadChoice:
    """The answer `raw`, its first `choice`, the generated `ids` and `logprobs`, with `choices[0].finish_reason`."""
    reason = fields.finish_reason(
        fields.get_field(choice, "finish_reason", "choices[0]", str, required=False), "choices[0].finish_reason"
    )
    return ReadChoice(raw, choice, ids, logprobs, reason)


class CompletionsProtocol(ServerProtocol):
    """`/v1/completions` with a token-id prompt; a server's module says its fields and reads its answer.

    Attributes:
        sampled_logprobs: The default `logprobs` field that asks for the sampled token's log-prob.
        too_old: What to do about a server that ignored `return_token_ids`, for the error.
    """

    generate_path = COMPLETIONS_PATH
    salt_field = "cache_salt"
    sampled_logprobs: ClassVar[int]
    too_old: ClassVar[str]

    # A server's own functions: the body without prompt, logprobs and salt; the answer once its ids are read.
    top_level: ClassVar[staticmethod[[Mapping[str, Any], bool, int, str | None], dict[str, Any]]]
    parsed: ClassVar[staticmethod[[ReadChoice, GenerateCall, RouteLimits], ParsedResponse]]

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        body = self.top_level(call.sampling_params, call.return_routed_experts, call.start, call.model)
        body["prompt"] = call.prompt
        body.setdefault("logprobs", self.sampled_logprobs)  # the sampled token's logprob, which RL needs
        return self.salted(body, call)

    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        choice = fields.first_choice(raw)
        ids = generated_ids(choice, "token_ids", self.too_old)
        sent_back = fields.get_field(choice, "prompt_token_ids", "choices[0]", list, required=False)
        # The echo equal to the prompt and every item a token id: accepted in two C passes; else the checks name it.
        if sent_back is not None and not (sent_back == call.prompt and all_token_ids(sent_back, TOKEN_ID_END)):
            if list(fields.token_ids(sent_back, "choices[0].prompt_token_ids")) != call.prompt:
                raise WireFormatError("choices[0].prompt_token_ids is not the prompt that was sent")
        logprobs = fields.completion_logprobs(choice, len(ids))
        return self.parsed(read_choice(raw, choice, ids, logprobs), call, limits)


def top_level(params: Mapping[str, Any], own: Sequence[str], model: str | None) -> dict[str, Any]:
    """The caller's fields with `return_token_ids` and `model` set.

    Raises:
        ValueError: `params` holds one of the fields the client sets itself (`own`).
    """
    for key in own:
        if key in params:
            raise ValueError(f"sampling_params must not hold {key!r}: the client sets it")
    body: dict[str, Any] = dict(params)
    body["return_token_ids"] = True
    if model is not None:
        body["model"] = model
    return body


def generated_ids(choice: Mapping[str, Any], key: str, too_old: str) -> tuple[int, ...]:
    """`choice[key]`, the generated token ids that `return_token_ids` asked for.

    Raises:
        WireFormatError: They are missing (naming `too_old`, what to do) or not token ids.
    """
    value = fields.get_field(choice, key, "choices[0]", list, required=False)
    if value is None:
        raise WireFormatError(f"choices[0].{key} is missing: the server ignored return_token_ids ({too_old})")
    return fields.token_ids(value, f"choices[0].{key}")


def rendered_prompt(value: Any, where: str, start: int, start_field: str, too_old: str) -> tuple[int, ...]:
    """The prompt ids a chat answer says the server's template rendered, with the route start checked against them.

    Raises:
        WireFormatError: They are missing (the rows could not be matched to
            tokens), not token ids, or shorter than `start`.
    """
    if value is None:
        raise WireFormatError(
            f"{where} is missing: the server rendered the messages with its chat template and "
            "did not say into which tokens, so routes cannot be matched to positions (the client sends "
            f"return_token_ids: true; {too_old})"
        )
    prompt = fields.token_ids(value, where)
    if start > len(prompt):
        raise WireFormatError(f"{start_field} {start} is past the {len(prompt)}-token prompt the server rendered")
    return prompt
