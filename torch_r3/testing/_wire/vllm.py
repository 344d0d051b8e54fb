"""vLLM's native `POST /inference/v1/generate`, as a server launched with `--enable-return-routed-experts` answers it.

Request: `token_ids`, `sampling_params` (`max_tokens`, `temperature`, `seed`,
`stop_token_ids`, `ignore_eos`, `logprobs`, `n` (1 only) and
`routed_experts_prompt_start` in `[0, P]`), `return_token_ids`, and the
top-level `cache_salt`: requests share prefix-cache blocks only with an equal
salt; an empty salt, one over 128 characters or one holding `@`, `/`, `\\`
or NUL is refused with `400`, as vLLM 0.30+ does. There is no
per-request routes switch: other top-level fields (`return_routed_experts`
among them) are ignored, as vLLM ignores them.

Response: `{"request_id", "choices": [{"index", "token_ids", "finish_reason",
"logprobs", "routed_experts"}], "prompt_token_ids", "usage"}`. `finish_reason`
is a string (`"stop"`, `"length"`, `"abort"`); `logprobs` is
`{"content": [{"token_id", "logprob", "rank", "top_logprobs"}]}` when
`sampling_params.logprobs` is set (`rank` is `null`: the served model reports
only the sampled token's log-probability), else `null`. `routed_experts` is the
standard base64 of a `.npy` file (header included) of rows
`[start, P + O - 1)` over every hidden layer, `uint8` when the model has at
most 256 experts, else `uint16`; it is `null` when the server runs without the
flag or the request was aborted before any forward pass. `weight_versions`
(vLLM 0.32+) holds the `{version, start, end}` spans over the generated
tokens: one span here, since weights change only between requests.
"""

from __future__ import annotations

import base64
import io
import uuid
from typing import Any

import numpy as np

from torch_r3.rollout.protocols.vllm import GENERATE_PATH, RESET_PREFIX_CACHE_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import (
    VLLM_SAMPLING,
    WireProtocol,
    check_body,
    check_bool,
    check_int,
    vllm_request,
    vllm_sampling,
    weight_spans,
)
from torch_r3.testing.model import ServedModel

__all__ = ["VLLMWire", "npy_bytes"]


# vLLM's sampling parameter -> the model's (None: read here, not passed on).
_SAMPLING: dict[str, str | None] = {**VLLM_SAMPLING, "logprobs": None, "n": None, "routed_experts_prompt_start": None}


class VLLMWire(WireProtocol):
    """vLLM's `/inference/v1/generate` (see the module docstring)."""

    name = "vllm"
    generate_path = GENERATE_PATH
    flush_cache_path = RESET_PREFIX_CACHE_PATH
    default_block_size = 16

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = check_body(body, "token_ids", None)  # vLLM ignores unknown top-level fields
        raw, params, start = vllm_sampling(body, prompt, _SAMPLING)
        check_int(raw.get("n", 1), "n", 1, 1)
        logprobs = raw.get("logprobs")
        if logprobs is not None:
            check_int(logprobs, "logprobs", 0, 20)
        request_id = body.get("request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        options = {
            "logprobs": logprobs is not None,
            "return_token_ids": check_bool(body.get("return_token_ids", False), "return_token_ids"),
            "request_id": request_id or uuid.uuid4().hex,
        }
        return vllm_request(body, prompt, params, start, options)

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        out = generation.token_ids
        rows = None
        payload = None
        if self.routes_enabled and generation.routes is not None:
            dtype = np.dtype("<u1") if model.num_experts <= 256 else np.dtype("<u2")
            rows = np.ascontiguousarray(generation.routes[request.start :], dtype=dtype)
            payload = base64.b64encode(npy_bytes(rows, claim_rows=rows.shape[0] + 1 if malformed else None)).decode(
                "ascii"
            )
        logprobs: dict[str, Any] | None = None
        if request.options["logprobs"]:
            logprobs = {
                "content": [
                    {"token_id": t, "logprob": lp, "rank": None, "top_logprobs": []}
                    for t, lp in zip(out, generation.logprobs)
                ]
            }
        choice = {
            "index": 0,
            "token_ids": out,
            "finish_reason": generation.finish_reason,
            "logprobs": logprobs,
            "routed_experts": payload,
            "weight_versions": weight_spans(generation),
        }
        body = {
            "request_id": request.options["request_id"],
            "choices": [choice],
            "prompt_token_ids": request.prompt if request.options["return_token_ids"] else None,
            "usage": {
                "prompt_tokens": len(request.prompt),
                "completion_tokens": len(out),
                "total_tokens": len(request.prompt) + len(out),
            },
        }
        return body, rows

    def error(self, status: int, message: str) -> dict[str, Any]:
        return {
            "error": {"message": message, "type": "BadRequestError" if status == 400 else "ServerError", "code": status}
        }


def npy_bytes(array: np.ndarray, *, claim_rows: int | None = None) -> bytes:
    """`array` as the bytes of a `.npy` file (no pickle), optionally claiming another row count.

    Examples:
        >>> import numpy as np
        >>> data = npy_bytes(np.zeros((2, 1, 2), np.uint8))
        >>> np.load(io.BytesIO(data), allow_pickle=False).shape
        (2, 1, 2)
    """
    buffer = io.BytesIO()
    if claim_rows is None:
        np.lib.format.write_array(buffer, array, allow_pickle=False)
    else:  # a header that disagrees with the data that follows it
        header = np.lib.format.header_data_from_array_1_0(array)
        header["shape"] = (claim_rows, *array.shape[1:])
        np.lib.format.write_array_header_1_0(buffer, header)
        buffer.write(array.tobytes())
    return buffer.getvalue()
