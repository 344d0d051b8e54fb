"""vLLM's OpenAI-compatible `POST /v1/completions` with a token-id prompt, as vLLM 0.33 answers it.

Request: `prompt` (token ids), top-level `max_tokens`, `temperature`, `seed`,
`stop_token_ids`, `ignore_eos`, `logprobs`, `n` (1 only), `return_token_ids`,
`return_weight_versions`, `routed_experts_prompt_start` in `[0, P]`, `cache_salt`
(vLLM's rules) and `model`; other fields are ignored, as vLLM ignores them.
Response: `{"id", "object": "text_completion", "model", "choices": [{"index",
"text", "logprobs": {"token_logprobs", "tokens", ...} | null, "finish_reason",
"token_ids", "prompt_token_ids", "routed_experts", "weight_versions"}], "usage"}`:
`routed_experts` is base64 `.npy` as on the native endpoint; the token ids and
the spans come only when asked for.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np

from torch_r3.protocols.vllm import RESET_PREFIX_CACHE_PATH
from torch_r3.protocols.vllm_openai import COMPLETIONS_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import WireProtocol, check_body, check_bool, check_int, check_salt, weight_spans
from torch_r3.testing._wire.vllm import npy_bytes
from torch_r3.testing.model import ServedModel

__all__ = ["VLLMCompletionsWire"]

_SAMPLING = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}


class VLLMCompletionsWire(WireProtocol):
    """vLLM's `/v1/completions` (see the module docstring)."""

    name = "vllm-openai"
    generate_path = COMPLETIONS_PATH
    flush_cache_path = RESET_PREFIX_CACHE_PATH

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = check_body(body, "prompt", None)
        check_int(body.get("n", 1), "n", 1, 1)
        logprobs = body.get("logprobs")
        if logprobs is not None:
            check_int(logprobs, "logprobs", 0, 20)
        start = check_int(body.get("routed_experts_prompt_start", 0), "routed_experts_prompt_start", 0, len(prompt))
        params = {name: body[k] for k, name in _SAMPLING.items() if body.get(k) is not None}
        return GenerateRequest(
            prompt=prompt,
            sampling_params=params,
            return_routes=True,
            start=start,
            salt=check_salt(body.get("cache_salt"), "cache_salt", vllm_rules=True),
            options={
                "logprobs": logprobs is not None,
                "token_ids": check_bool(body.get("return_token_ids", False), "return_token_ids"),
                "spans": check_bool(body.get("return_weight_versions", False), "return_weight_versions"),
                "model": body.get("model") or "loopback",
            },
        )

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        out = generation.token_ids
        rows = payload = None
        if self.routes_enabled and generation.routes is not None:
            dtype = np.dtype("<u1") if model.num_experts <= 256 else np.dtype("<u2")
            rows = np.ascontiguousarray(generation.routes[request.start :], dtype=dtype)
            claim = rows.shape[0] + 1 if malformed else None
            payload = base64.b64encode(npy_bytes(rows, claim_rows=claim)).decode("ascii")
        logprobs = None
        if request.options["logprobs"]:
            logprobs = {
                "text_offset": list(range(len(out))),
                "token_logprobs": list(generation.logprobs),
                "tokens": [f"token_id:{t}" for t in out],
                "top_logprobs": [None] * len(out),
            }
        choice = {
            "index": 0,
            "text": "",
            "logprobs": logprobs,
            "finish_reason": generation.finish_reason,
            "token_ids": out if request.options["token_ids"] else None,
            "prompt_token_ids": request.prompt if request.options["token_ids"] else None,
            "routed_experts": payload,
            "weight_versions": weight_spans(generation) if request.options["spans"] else None,
        }
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "model": request.options["model"],
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(request.prompt),
                "completion_tokens": len(out),
                "total_tokens": len(request.prompt) + len(out),
            },
        }
        return body, rows
