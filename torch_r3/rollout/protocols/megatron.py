"""Megatron-core's dynamic inference server, `POST /v1/completions` (megatron-core 0.19).

Request: `{"prompt": [token ids], "max_tokens", "temperature", "top_p", "top_k",
"stop", "logprobs": 1}`, OpenAI-style names at the top level. The server has no
route start field and no cache salt: every answer carries the routes of every
position from 0, and the client keeps the rows from the start it was asked for.
Routes are recorded when the model runs with `moe_enable_routing_replay=True`
(`--moe-enable-routing-replay`); the dynamic engine refuses replay with its
asynchronous scheduling.

Answer: `choices[0]` with `prompt_token_ids`, `generation_token_ids`,
`generation_log_probs`, a string `finish_reason`, `moe_topk_indices` (every
position's routes `[P + O - 1, layers, topk]`; megatron-core 0.19.2 sends them
as its serialised NumPy array, `["ndarray", {"data": nested lists, "dtype":
"int16"}]`, plain nested lists are accepted too; `prompt_moe_topk_indices`
is not read: 0.19.2 slices the wrapper rather than the rows), and the weight
epochs as sparse `[[first_position, epoch], ...]` boundary lists:
`policy_epoch` (the weights that ran each position: generated token `j` was
sampled from position `P + j - 1`) and `kv_cache_epoch` (the weights that
computed each position's KV cache, and with it its stored routes). A
`kv_cache_epoch` older than the policy's means a prefix cached before a weight
update was reused: its routes come from the older policy. The result reports
the policy epochs as `weight_versions` over the generated tokens and the KV
epochs as `route_versions` over the rows; `RoutedExpertTrace.record_result`
refuses a turn that mixes them (unless `allow_mixed_versions`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols import fields
from torch_r3.rollout.protocols.base import GenerateCall, ParsedResponse, RouteLimits, ServerProtocol
from torch_r3.rollout.protocols.fields import WeightVersionSpan
from torch_r3.rollout.protocols.switches import missing_routes_hint
from torch_r3.routes import compact_routes

# Reached by `RemoteGenerateClient(server="megatron")`.
__all__: list[str] = []

GENERATE_PATH = "/v1/completions"
_OWN_FIELDS = ("prompt", "stream", "echo")
_ROUTE_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")


class MegatronProtocol(ServerProtocol):
    """Megatron-core's inference server (see the module docstring)."""

    name = "megatron"
    generate_path = GENERATE_PATH
    salt_field = ""
    route_payload_paths = (("choices", "*", "moe_topk_indices"), ("choices", "*", "prompt_moe_topk_indices"))

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        for key in (*_OWN_FIELDS, fields.PROMPT_START_PARAM):
            if key in call.sampling_params:
                raise ValueError(f"sampling_params must not hold {key!r}: the client sets it")
        if call.cache_salt is not None:
            raise ValueError(
                "Megatron's inference server has no cache salt: flush its prefix cache after a weight update "
                "(the client checks kv_cache_epoch against policy_epoch)"
            )
        if call.model is not None:
            raise ValueError("Megatron's inference server serves one model: leave model= unset")
        body: dict[str, Any] = dict(call.sampling_params)
        body["prompt"] = call.prompt
        body.setdefault("logprobs", 1)
        return body

    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        choice = fields.first_choice(raw)
        ids = fields.token_ids(
            fields.get_field(choice, "generation_token_ids", "choices[0]", list), "choices[0].generation_token_ids"
        )
        sent = fields.get_field(choice, "prompt_token_ids", "choices[0]", list, required=False)
        if sent is not None and list(fields.token_ids(sent, "choices[0].prompt_token_ids")) != call.prompt:
            raise WireFormatError("choices[0].prompt_token_ids is not the prompt that was sent")
        reason = fields.finish_reason(
            fields.get_field(choice, "finish_reason", "choices[0]", str, required=False), "choices[0].finish_reason"
        )
        logprobs = None
        values = fields.get_field(choice, "generation_log_probs", "choices[0]", list, required=False)
        if values:
            if len(values) != len(ids):
                raise WireFormatError(
                    f"choices[0].generation_log_probs has {len(values)} entries for {len(ids)} tokens"
                )
            logprobs = tuple(fields.logprob(v, f"choices[0].generation_log_probs[{i}]") for i, v in enumerate(values))
        rows = len(call.prompt) + len(ids) - 1
        policy = _epochs(choice.get("policy_epoch"), "choices[0].policy_epoch", rows)
        kv = _epochs(choice.get("kv_cache_epoch"), "choices[0].kv_cache_epoch", rows)
        spans = _token_spans(policy, len(call.prompt), len(ids))
        routes = None
        route_versions: tuple[WeightVersionSpan, ...] = ()
        payload = choice.get("moe_topk_indices")
        if call.return_routed_experts:
            if payload is None and not ids:
                reason = "abort"  # finished before any forward pass: no row to replay
            elif payload is None:
                raise WireFormatError(
                    f"routes were requested but choices[0].moe_topk_indices is missing ({missing_routes_hint('megatron')})"
                )
        if payload is not None and call.return_routed_experts:
            full = _routes(payload, limits, "choices[0].moe_topk_indices")
            want = fields.expected_rows(len(call.prompt), len(ids), 0)
            if full.shape[0] != want:
                raise WireFormatError(
                    f"choices[0].moe_topk_indices has {full.shape[0]} rows; positions 0 .. {rows - 1} "
                    f"({len(call.prompt)} prompt + {len(ids)} generated tokens) need {want}"
                )
            # The server always sends every row from 0: keep those asked for (a copy frees the rest).
            routes = full[call.start :].copy() if call.start else full
            route_versions = _row_spans(kv, call.start, rows)
        version = spans[-1].version if spans else None
        return ParsedResponse(ids, logprobs, reason, routes, version, spans, route_versions)


def _routes(payload: Any, limits: RouteLimits, where: str) -> np.ndarray:
    data: Any = payload
    dtype = None
    if isinstance(payload, list) and len(payload) == 2 and payload[0] == "ndarray":
        wrapper = payload[1]
        data = fields.get_field(wrapper, "data", f"{where}[1]", list)
        dtype = fields.get_field(wrapper, "dtype", f"{where}[1]", str)
        if dtype not in _ROUTE_DTYPES:
            raise WireFormatError(f"{where}[1].dtype: expected an integer dtype, got {dtype!r:.40}")
    elif not isinstance(payload, list):
        raise WireFormatError(f"{where}: expected nested lists [rows][layers][topk], got {type(payload).__name__}")
    try:
        array = np.array(data, dtype=np.int64)
    except (ValueError, TypeError, OverflowError) as exc:
        raise WireFormatError(f"{where}: not a rectangular array of integer expert ids ({exc})") from None
    if array.ndim != 3 and not (array.ndim == 1 and array.size == 0):
        raise WireFormatError(f"{where}: expected [rows, layers, topk], got {array.ndim}-D shape {array.shape}")
    if array.ndim == 1:
        array = array.reshape(0, limits.num_layers or 1, limits.topk or 1)
    if array.nbytes > limits.max_bytes * 8:
        raise WireFormatError(f"{where}: {array.nbytes} bytes decoded, past the route cap")
    for axis, want, what in ((1, limits.num_layers, "num_layers"), (2, limits.topk, "topk")):
        if want is not None and array.shape[axis] != want:
            raise WireFormatError(f"{where}: shape {array.shape}, expected {what}={want} on axis {axis}")
    try:
        return compact_routes(array, name=where, num_experts=limits.num_experts, health=None)
    except ValueError as exc:
        raise WireFormatError(str(exc)) from None


def _epochs(value: Any, where: str, rows: int) -> list[tuple[int, int]]:
    """The sparse `[[first_position, epoch], ...]` list, checked (empty when absent)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise WireFormatError(f"{where}: expected a list of [first_position, epoch] pairs, got {type(value).__name__}")
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(value):
        ok = (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
        )
        if not ok:
            raise WireFormatError(f"{where}[{i}]: expected [first_position, epoch], got {pair!r:.60}")
        if out and pair[0] < out[-1][0]:
            raise WireFormatError(f"{where}[{i}]: positions must not decrease ({pair[0]} after {out[-1][0]})")
        if not 0 <= pair[0] <= max(rows, 0):
            raise WireFormatError(f"{where}[{i}]: position {pair[0]} is outside the {rows} positions")
        out.append((pair[0], pair[1]))
    return out


def _epoch_at(epochs: list[tuple[int, int]], position: int) -> int | None:
    current = None
    for first, epoch in epochs:
        if first > position:
            break
        current = epoch
    return current


def _runs(versions: list[int | None]) -> tuple[WeightVersionSpan, ...]:
    spans: list[WeightVersionSpan] = []
    for i, v in enumerate(versions):
        if v is None:
            continue
        if spans and spans[-1].version == str(v) and spans[-1].end == i:
            spans[-1] = WeightVersionSpan(str(v), spans[-1].start, i + 1)
        else:
            spans.append(WeightVersionSpan(str(v), i, i + 1))
    return tuple(spans)


def _token_spans(policy: list[tuple[int, int]], prompt_len: int, generated: int) -> tuple[WeightVersionSpan, ...]:
    """Spans over the generated tokens: token `j` was sampled from position `prompt_len + j - 1`."""
    if not policy:
        return ()
    return _runs([_epoch_at(policy, prompt_len + j - 1) for j in range(generated)])


def _row_spans(kv: list[tuple[int, int]], start: int, rows: int) -> tuple[WeightVersionSpan, ...]:
    """Spans over the returned rows (0 = position `start`) of the epoch that computed their KV cache."""
    if not kv:
        return ()
    return _runs([_epoch_at(kv, p) for p in range(start, rows)])


PROTOCOL = MegatronProtocol()
