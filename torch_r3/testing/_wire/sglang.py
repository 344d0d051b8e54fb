"""SGLang's native `POST /generate`, as a server launched with `--enable-return-routed-experts` answers it.

Request: `input_ids` (no tokenizer here, so no `text`), `sampling_params`
(`max_new_tokens`, `temperature`, `sampling_seed`, `stop_token_ids`,
`ignore_eos`; `max_new_tokens=0` is a prefill-only request, answered with no
tokens and `P - 1` route rows), `return_logprob`, `return_routed_experts`,
`routed_experts_start_len` (top level, in `[0, P]`), `rid`, and `extra_key`:
SGLang's own request field that becomes part of its radix-cache key, so
requests share cached prefixes only with an equal `extra_key` (SGLang's
OpenAI-compatible routes put `cache_salt` there). Any other field is refused.

Response: top-level `text` and `output_ids`; `meta_info` with `id`,
`finish_reason` (an object: `{"type": "stop", "matched": id}`,
`{"type": "length", "length": n}` or `{"type": "abort", "message": str}`),
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `weight_version`,
`weight_versions` (0.5.19+: `{version, start, end}` spans over the generated
tokens; one span here, since weights change only between requests),
`output_token_logprobs` (`[logprob, token_id, null]` per token, with
`return_logprob`; a -inf or NaN log-prob is written `null`, as SGLang's schema
does) and `routed_experts`: standard base64 of the flat
little-endian int32 rows `[start, P + O - 1)` over every hidden layer, no
header. An aborted request has no `routed_experts` key. With
`sampling_params.n > 1` the answer is a JSON list of such objects, one per
sample, as SGLang sends it.

Options mimic versions: `ignores_start=True` behaves like sglang 0.5.10.post1,
which accepts `routed_experts_start_len` but returns every row from 0;
`routes_dtype="uint8"`/`"uint16"` narrows the payload and announces it in
`meta_info.routed_experts_dtype`, as a newer SGLang may.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import uuid
from typing import Any

import numpy as np

from torch_r3._checks import check_bool as check_flag, check_choice
from torch_r3.rollout.protocols.sglang import FLUSH_CACHE_PATH, GENERATE_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import (
    WireProtocol,
    check_body,
    check_bool,
    check_int,
    check_known,
    check_object,
    weight_spans,
)
from torch_r3.testing.model import ServedModel

__all__ = ["SGLangWire"]


_FIELDS = frozenset(
    {
        "input_ids",
        "sampling_params",
        "return_logprob",
        "return_routed_experts",
        "routed_experts_start_len",
        "rid",
        "extra_key",
        "stream",
        "return_indexer_topk",
    }
)
# SGLang's sampling parameter -> the model's.
_SAMPLING: dict[str, str | None] = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "sampling_seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": None,  # read here: samples per request
}
_NARROW: dict[str, tuple[np.dtype, int]] = {"uint8": (np.dtype("<u1"), 256), "uint16": (np.dtype("<u2"), 65536)}


class SGLangWire(WireProtocol):
    """SGLang's `/generate` (see the module docstring).

    Args:
        routes_enabled: `False`: launched without the flag, no `routed_experts` key.
        ignores_start: Return every row from 0 whatever start was asked (sglang 0.5.10.post1).
        routes_dtype: `None` (int32, no dtype key) or `"uint8"`/`"uint16"`.
        indexer: An object with `select(tokens) -> [n, layers, index_topk]` int32
            (`torch_r3.testing.indexer.IndexerLM`) that answers `return_indexer_topk`;
            `None`: launched without `--enable-return-indexer-topk`.
    """

    name = "sglang"
    generate_path = GENERATE_PATH
    flush_cache_path = FLUSH_CACHE_PATH
    default_block_size = 1  # a radix tree with page size 1 matches any prefix length

    def __init__(
        self,
        *,
        routes_enabled: bool = True,
        ignores_start: bool = False,
        routes_dtype: str | None = None,
        indexer: Any = None,
    ) -> None:
        super().__init__(routes_enabled=routes_enabled)
        if indexer is not None and not callable(getattr(indexer, "select", None)):
            raise TypeError(f"indexer must have a select(tokens) method, got {type(indexer).__name__}")
        self.indexer = indexer
        self.ignores_start = check_flag(ignores_start, "ignores_start")
        if routes_dtype is not None:
            check_choice(routes_dtype, "routes_dtype", sorted(_NARROW))
        self.routes_dtype = routes_dtype

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = check_body(body, "input_ids", _FIELDS, hint=" (this server has no tokenizer for 'text')")
        if body.get("stream", False) is not False:
            raise ValueError("stream must be false: this server does not stream")
        raw = body.get("sampling_params") or {}
        check_known(check_object(raw, "sampling_params"), _SAMPLING, "unsupported sampling_params")
        samples = check_int(raw.get("n", 1), "sampling_params.n", 1, 16)
        params = {name: v for k, v in raw.items() if (name := _SAMPLING[k]) is not None}
        # Prefill only: the model generates one token, which the response then drops
        # (with its route row), leaving the P - 1 rows SGLang returns for it.
        prefill_only = params.get("max_new_tokens") == 0 and not isinstance(params["max_new_tokens"], bool)
        if prefill_only:
            params["max_new_tokens"] = 1
        start = check_int(body.get("routed_experts_start_len", 0), "routed_experts_start_len", 0, len(prompt))
        salt = body.get("extra_key")
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"extra_key must be a string, got {type(salt).__name__}")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise TypeError(f"rid must be a string, got {type(rid).__name__}")
        if self.routes_dtype is not None and model.num_experts > _NARROW[self.routes_dtype][1]:
            raise ValueError(f"routes_dtype {self.routes_dtype} cannot hold {model.num_experts} experts")
        return GenerateRequest(
            prompt=prompt,
            sampling_params=params,
            return_routes=check_bool(body.get("return_routed_experts", False), "return_routed_experts"),
            start=start,
            salt=salt,
            options={
                "return_logprob": check_bool(body.get("return_logprob", False), "return_logprob"),
                "rid": rid or uuid.uuid4().hex,
                "prefill_only": prefill_only,
                "samples": samples,
                "indexer_topk": check_bool(body.get("return_indexer_topk", False), "return_indexer_topk"),
            },
        )

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        if request.options["prefill_only"] and generation.routes is not None:
            generation = dataclasses.replace(
                generation, token_ids=[], logprobs=[], routes=generation.routes[:-1], finish_reason="length"
            )
        out = generation.token_ids
        meta: dict[str, Any] = {
            "id": request.options["rid"],
            "finish_reason": _finish_reason(generation),
            "prompt_tokens": len(request.prompt),
            "completion_tokens": len(out),
            "cached_tokens": generation.cached_tokens,
            "weight_version": generation.weight_version,
            "weight_versions": weight_spans(generation),
        }
        if request.options["return_logprob"]:
            # SGLang's schema writes a non-finite log-prob (-inf, NaN) as null.
            meta["output_token_logprobs"] = [
                [lp if math.isfinite(lp) else None, t, None] for lp, t in zip(generation.logprobs, out)
            ]
        rows = None
        if request.return_routes and self.routes_enabled and generation.routes is not None:
            dtype = _NARROW[self.routes_dtype][0] if self.routes_dtype else np.dtype("<i4")
            first = 0 if self.ignores_start else request.start  # sglang 0.5.10 sends every row
            rows = np.ascontiguousarray(generation.routes[first:], dtype=dtype)
            data = rows.tobytes()
            if malformed:  # one id short: the length is no longer a whole number of rows
                data = data[: -dtype.itemsize]
            meta["routed_experts"] = base64.b64encode(data).decode("ascii")
            if self.routes_dtype:
                meta["routed_experts_dtype"] = self.routes_dtype
        if request.options["indexer_topk"] and self.indexer is not None:
            # Every evaluated position, from 0 (SGLang has no start for these): the last token never ran.
            seen = list(request.prompt) + list(out)
            chosen = np.ascontiguousarray(self.indexer.select(seen)[: len(seen) - 1], dtype="<i4")
            meta["indexer_topk"] = base64.b64encode(chosen.tobytes()).decode("ascii")
        text = "".join(f"<{t}>" for t in out)  # no tokenizer: a readable stand-in
        return {"text": text, "output_ids": out, "meta_info": meta}, rows


def _finish_reason(generation: Generation) -> dict[str, Any]:
    if generation.finish_reason == "abort":
        return {"type": "abort", "message": "request aborted"}
    if generation.finish_reason == "stop":
        return {"type": "stop", "matched": generation.token_ids[-1]}
    return {"type": "length", "length": len(generation.token_ids)}
