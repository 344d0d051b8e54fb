"""Megatron-core's dynamic inference server, `POST /v1/completions`, as megatron-core 0.19.2 answers it.

Request: `prompt` (token ids), `max_tokens`, `temperature`, `logprobs`.
Response: `choices[0]` with `prompt_token_ids`, `generation_token_ids`,
`generation_log_probs`, `finish_reason`, `policy_epoch` and `kv_cache_epoch`
(`[[0, epoch]]`: weights change only between requests here, and the epoch is
the weight version when it is an integer, else 0), `num_evictions` and
`moe_topk_indices` as megatron-core serialises its NumPy array:
`["ndarray", {"data": nested lists of every row from position 0, "dtype": "int16"}]`.
There is no start field and no cache salt: every row comes back.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from torch_r3.rollout.protocols.megatron import GENERATE_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import WireProtocol, check_body, check_int
from torch_r3.testing.model import ServedModel

__all__ = ["MegatronWire"]


class MegatronWire(WireProtocol):
    """Megatron-core's `/v1/completions` (see the module docstring)."""

    name = "megatron"
    generate_path = GENERATE_PATH

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = check_body(body, "prompt", None)
        params: dict[str, Any] = {"max_new_tokens": check_int(body.get("max_tokens", 16), "max_tokens", 0, 1 << 20)}
        if body.get("temperature") is not None:
            params["temperature"] = body["temperature"]
        return GenerateRequest(prompt=prompt, sampling_params=params, return_routes=True, options={})

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        out = generation.token_ids
        rows = None
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": generation.finish_reason,
            "prompt_token_ids": request.prompt,
            "generation_token_ids": out,
            "generation_log_probs": list(generation.logprobs),
        }
        version = generation.weight_version
        epoch = int(version) if version.isdigit() else 0
        choice.update(policy_epoch=[[0, epoch]], kv_cache_epoch=[[0, epoch]], num_evictions=0)
        if self.routes_enabled and generation.routes is not None:
            rows = np.ascontiguousarray(generation.routes, dtype=np.int16)
            data = rows.tolist()
            if malformed:
                data = data[:-1]
            wrapped = ["ndarray", {"data": data, "dtype": "int16"}]
            choice["moe_topk_indices"] = wrapped
            choice["prompt_moe_topk_indices"] = wrapped  # as 0.19.2 sends it: the wrapper sliced, not the rows
        body = {
            "id": str(uuid.uuid4()),
            "object": "text_completion",
            "model": "EMPTY",
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(request.prompt),
                "completion_tokens": len(out),
                "total_tokens": len(request.prompt) + len(out),
            },
        }
        return body, rows
