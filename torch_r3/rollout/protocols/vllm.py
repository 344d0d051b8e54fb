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
256 experts, else `uint16`, in every release since routes came to this endpoint
with 0.22), or `null` when the server runs without the flag or the request was
aborted before any forward pass.
vLLM 0.32+ reports `choices[0].weight_versions`, spans `{version, start,
end}` over the generated tokens; the newest is the weight version (older
servers report none). `cache_salt` must be at most 128 characters without
`@`, `/`, `\\` or NUL (vLLM 0.30+ answers others with 400). Since vLLM 0.30
`/inference/v1/generate` exists only with `--enable-scale-out`. Every release with
routes here takes `routed_experts_prompt_start` in `sampling_params` (0.22 to 0.29
only below the prompt's length: a start equal to it fails an assertion in the
engine; 0.30+ accept `0 <= s <= P` and refuse others up front); an answer with
every row from position 0 all the same is recognised by its row count and sliced.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_r3.rollout.protocols._choices import ContentLogprobsProtocol, npy_routes
from torch_r3.rollout.protocols.base import GenerateCall, RouteLimits
from torch_r3.rollout.protocols.switches import missing_routes_hint

# Reached by `RemoteGenerateClient(server="vllm")`: the docstring above is this
# server's format; `VLLMProtocol`, its paths and `PROTOCOL` serve the client.
__all__: list[str] = []

GENERATE_PATH = "/inference/v1/generate"
#: vLLM's endpoint that drops its prefix cache.
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"


class VLLMProtocol(ContentLogprobsProtocol):
    """vLLM's native `/inference/v1/generate` (see the module docstring)."""

    name = "vllm"
    generate_path = GENERATE_PATH
    null_routes_hint = f" ({missing_routes_hint('vllm')})"
    check_logprob_ids = True

    def flags(self, call: GenerateCall) -> dict[str, Any]:
        return {"return_token_ids": True}

    def decode(self, payload: Any, limits: RouteLimits) -> np.ndarray:
        return npy_routes(payload, limits)


PROTOCOL = VLLMProtocol()
