"""SGLang's native `POST /generate` (server flag `--enable-return-routed-experts`).

Request: `{"input_ids": [...], "sampling_params": {"max_new_tokens", ...},
"return_logprob": true, "return_routed_experts": bool,
"routed_experts_start_len"?: s, "extra_key"?: salt}`. The start is a top-level
field in `[0, P]`. `extra_key` is the request field SGLang folds into its
radix-cache key, so requests share cached prefixes only with an equal key.

Answer: top-level `output_ids`; `meta_info` with `finish_reason` (an object
`{"type": "stop" | "length" | "abort", ...}`), `output_token_logprobs`
(`[logprob, token_id, text | null]` per generated token; SGLang writes a
-inf or NaN log-prob as `null`, read here as NaN), `weight_version` (the
newest), `weight_versions` (0.5.19+: `{version, start, end}` spans over the
generated tokens, more than one when a weight update landed mid-request),
and `routed_experts`: base64 of the flat little-endian rows over every hidden
layer, `int32` unless `routed_experts_dtype` names a narrower dtype. The layer
and top-k counts are not in the payload: the client must be given them. An
aborted request may have no `routed_experts` key.

With `sampling_params.n > 1` SGLang answers a JSON list, one output per
sample; the client refuses such an `n` before sending.

With `"return_indexer_topk": true` (server flag `--enable-return-indexer-topk`,
DP attention, DSA models), `meta_info.indexer_topk` carries the indexer's
selections of positions `[0, P + O - 1)`: base64 of flat little-endian `int32`
`[rows, num_indexer_layers, index_topk]` (no start: every turn sends every row),
decoded into `torch_r3.indexer.IndexerSelections`.

sglang 0.5.10.post1 accepts `routed_experts_start_len` but ignores it and
returns every row from position 0; that answer is recognised by its row count
and sliced here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_r3.rollout.codec import WireFormatError, decode_sglang_routes
from torch_r3.rollout.protocols import fields
from torch_r3.rollout.protocols._lists import sglang_logprobs
from torch_r3.rollout.protocols.base import GenerateCall, ParsedResponse, RouteLimits, ServerProtocol
from torch_r3.rollout.protocols.switches import missing_routes_hint
from torch_r3.rollout.selections_wire import decode_sglang_indexer_topk

# Reached by `RemoteGenerateClient(server="sglang")`: the docstring above is this
# server's format; `SGLangProtocol`, its paths and `PROTOCOL` serve the client.
__all__: list[str] = []

GENERATE_PATH = "/generate"
#: SGLang's endpoint that drops its radix (prefix) cache.
FLUSH_CACHE_PATH = "/flush_cache"
_OWN_FIELDS = (
    "input_ids",
    "return_logprob",
    "return_routed_experts",
    "routed_experts_start_len",
    "extra_key",
    "return_indexer_topk",
)


class SGLangProtocol(ServerProtocol):
    """SGLang's native `/generate` (see the module docstring)."""

    name = "sglang"
    generate_path = GENERATE_PATH
    salt_field = "extra_key"
    needs_route_shape = True
    route_payload_paths = (("meta_info", "routed_experts"), ("meta_info", "indexer_topk"))
    route_text_paths = (("meta_info", "routed_experts"),)

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        for key in _OWN_FIELDS:
            if key in call.sampling_params:
                raise ValueError(f"sampling_params must not hold {key!r}: the client sets it at the top level")
        body: dict[str, Any] = {
            "input_ids": call.prompt,
            "sampling_params": dict(call.sampling_params),
            "return_logprob": True,
            "return_routed_experts": call.return_routed_experts,
        }
        if call.return_routed_experts and call.start:
            body["routed_experts_start_len"] = call.start
        if call.return_indexer_topk:
            body["return_indexer_topk"] = True
        if call.model is not None:
            raise ValueError(
                "SGLang's /generate has no model field: it serves one model (model= is for the other servers)"
            )
        return self.salted(body, call)

    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        if isinstance(raw, list):
            raise WireFormatError(
                f"response: SGLang answered a JSON list of {len(raw)} outputs, its answer to sampling_params.n > 1; "
                "the client asks for one sample per call (send n=1, call once per sample)"
            )
        ids = fields.token_ids(fields.get_field(raw, "output_ids", "response", list), "response.output_ids")
        meta = fields.get_field(raw, "meta_info", "response", dict)
        reason = fields.finish_reason(
            fields.get_field(meta, "finish_reason", "meta_info", (dict, str), required=False), "meta_info.finish_reason"
        )
        logprobs = _logprobs(meta, ids)
        routes = None
        if call.return_routed_experts:
            if meta.get("routed_experts") is None and reason == "abort":
                pass  # aborted: SGLang sends no routes
            else:
                if limits.num_layers is None or limits.topk is None:  # the client checks this before sending
                    raise ValueError("server='sglang' needs num_layers= and topk= to read routes")
                if meta.get("routed_experts") is None:
                    raise WireFormatError(
                        f"routes were requested but meta_info.routed_experts is missing ({missing_routes_hint('sglang')})"
                    )
                routes = sliced_routes(
                    meta, call, len(ids), limits, (limits.num_layers, limits.topk), "meta_info.routed_experts"
                )
        version = fields.weight_version(meta.get("weight_version"), "meta_info.weight_version")
        spans = fields.weight_spans(meta.get("weight_versions"), "meta_info.weight_versions", len(ids))
        selections = None
        if call.return_indexer_topk and not (meta.get("indexer_topk") is None and reason == "abort"):
            if limits.indexer_layers is None or limits.index_topk is None:  # the client checks this before sending
                raise ValueError("return_indexer_topk needs indexer_layers= and index_topk= to read selections")
            selections = decode_sglang_indexer_topk(
                meta,
                num_layers=limits.indexer_layers,
                index_topk=limits.index_topk,
                num_tokens=len(call.prompt) + len(ids) - 1,
                max_bytes=limits.max_indexer_bytes,
            )
        return ParsedResponse(
            ids, logprobs, reason, routes, fields.newest_version(version, spans), spans, indexer_topk=selections
        )


def sliced_routes(
    value: Any,
    call: GenerateCall,
    num_generated: int,
    limits: RouteLimits,
    shape: tuple[int, int],
    name: str,
    dtype: str | None = None,
) -> np.ndarray:
    """SGLang's routes `value` (`decode_sglang_routes`, rows of `shape` = layers x top-k) from the call's start.

    SGLang may ignore `routed_experts_start_len` and send every row from position 0;
    that answer is recognised by its row count and sliced (`fields.slice_to_start`).
    """
    decoded = decode_sglang_routes(
        value,
        num_layers=shape[0],
        topk=shape[1],
        dtype=dtype,
        num_experts=limits.num_experts,
        max_bytes=limits.max_bytes,
        name=name,
    )
    return fields.slice_to_start(
        decoded, call, num_generated, name, start_may_be_ignored=True, start_field="routed_experts_start_len"
    )


def _logprobs(meta: Any, ids: tuple[int, ...]) -> tuple[float, ...] | None:
    """`meta_info.output_token_logprobs`, one `[logprob, token_id, text]` per generated token, or `None`."""
    entries = fields.get_field(meta, "output_token_logprobs", "meta_info", list, required=False)
    if entries is None:
        return None
    if len(entries) != len(ids):
        raise WireFormatError(f"meta_info.output_token_logprobs has {len(entries)} entries for {len(ids)} tokens")
    fast = sglang_logprobs(entries, ids)  # a few C-level passes over the whole list; else the loop names the entry
    if fast is not None:
        return fast
    values = []
    for i, entry in enumerate(entries):
        where = f"meta_info.output_token_logprobs[{i}]"
        if not isinstance(entry, list) or len(entry) < 2:
            raise WireFormatError(f"{where}: expected [logprob, token_id, text], got {entry!r:.80}")
        if isinstance(entry[1], bool) or not isinstance(entry[1], int) or entry[1] != ids[i]:
            raise WireFormatError(f"{where}: token id {entry[1]!r} is not output_ids[{i}] = {ids[i]}")
        values.append(fields.logprob(entry[0], f"{where}[0]", null_is_nan=True))
    return tuple(values)


PROTOCOL = SGLangProtocol()
