"""`RemoteGenerateResult`: one generate call's answer, the same for every server and engine.

Its own module so that the in-process adapters (`torch_r3.rollout.inprocess`) return it
without importing aiohttp; `torch_r3.rollout.client` re-exports it, and documents it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torch_r3.rollout.protocols.fields import WeightVersionSpan

__all__ = ["RemoteGenerateResult"]


@dataclass(frozen=True, eq=False)
class RemoteGenerateResult:
    """One generate call's answer (one sample), the same for every server and engine.

    Attributes:
        response_ids: The generated token ids.
        response_logprobs: Their logprobs, or `None` when the server sent none.
        finish_reason: `"stop"`, `"length"` or `"abort"` (SGLang's object and
            vLLM's string normalised), another string a server sent, or `None`.
        routed_experts: The routes `[rows, layers, topk]` of positions
            `routed_experts_prompt_start .. len(prompt) + len(response_ids) - 2`,
            a canonical NumPy array; `None` when not requested, or when the
            request was aborted before any forward pass (`finish_reason` is
            then `"abort"`).
        weight_version: The server's weight version (SGLang's
            `meta_info.weight_version`, the torch_r3 server's `weight_version`,
            the last of vLLM's `weight_versions` spans), or `None` when the
            server reports none (vLLM before 0.32). When a weight update
            landed mid-request it is the newest version; `weight_versions`
            says which tokens each version generated.
        weight_versions: `WeightVersionSpan`s `(version, start, end)` over the
            generated tokens, as SGLang 0.5.19+ and vLLM 0.32+ report them;
            `()` when the server reports none. Pass them to
            `RoutedExpertTrace.record(weight_versions=)`, which refuses a turn
            routed by more than one version.
        num_experts: The client's `num_experts`: every id in `routed_experts`
            was checked to be below it on receipt (`None`: only checked to be
            non-negative). `RoutedExpertTrace.record_result` relies on it to
            skip a second scan.
        raw: The parsed JSON response without its route payload (the base64
            text, often far larger than the decoded `routed_experts`, is not
            kept); every other field as the server sent it. For an
            in-process vLLM result (`torch_r3.rollout.inprocess`), the engine's
            `RequestOutput` itself.
        health_checked: `routed_experts` passed (or was let through by) a
            `RouteHealthCheck` with the tokens behind its rows;
            `RoutedExpertTrace.record_result` then skips its own check.
        prompt_token_ids: The prompt's token ids as the engine saw them: for
            `RemoteGenerateClient.chat`, the server's rendering of the
            messages (key a multi-turn trace by these, not by your own
            tokenisation); otherwise the prompt that was sent.
        route_versions: `WeightVersionSpan`s over the rows of `routed_experts`
            (0 = its first row) naming the weights that computed them, from
            servers that report it (Megatron's `kv_cache_epoch`: a prefix
            cached before a weight update keeps its older routes); `()`
            otherwise. `RoutedExpertTrace.record_result` refuses a turn whose
            rows and tokens come from different versions.
        indexer_topk: With `return_indexer_topk=True` (SGLang, DSA models):
            the indexer's selections of positions `0 .. len(prompt) +
            len(response_ids) - 2` as compact `torch_r3.indexer.IndexerSelections`,
            every row checked on receipt; `None` otherwise.
    """

    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    finish_reason: str | None
    routed_experts: np.ndarray | None
    weight_version: str | None
    weight_versions: tuple[WeightVersionSpan, ...]
    num_experts: int | None
    raw: Any
    health_checked: bool = False
    prompt_token_ids: tuple[int, ...] | None = None
    route_versions: tuple[WeightVersionSpan, ...] = ()
    indexer_topk: Any = None
