"""What the released servers really send, and the traps of a new user.

The bodies in `tests/fixtures/divergences.json` have the shapes sglang 0.5.23's
and vllm 0.33.0's own response builders produce, as reported by a review that
ran them (written by hand with NumPy alone, not captured: see `make_fixtures.py`): SGLang's JSON list for `n > 1`, its `null` log-prob, and
both servers' `weight_versions` spans. Each is read by the protocol directly
and through `RemoteGenerateClient` from a real `aiohttp.web` server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from tests.http_stub import serve_routes
from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError, TransportConfig
from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols import PROTOCOLS, GenerateCall, RouteLimits, WeightVersionSpan
from torch_r3.rollout.trace import RoutedExpertTrace

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "divergences.json").read_text())
PROMPT = RECORDED["prompt"]
LIMITS = RouteLimits(max_bytes=1 << 20, **RECORDED["client"])
ROUTES = np.array(RECORDED["routes"])
SPANS = (WeightVersionSpan("step-7", 0, 1), WeightVersionSpan("step-8", 1, 3))


def recorded(name):
    return copy.deepcopy(RECORDED[name])


def parse(server, raw, *, routes=True):
    return PROTOCOLS[server].parse_response(raw, GenerateCall(PROMPT, {}, routes, 0), LIMITS)


async def serve(server, handler):
    return await serve_routes([("POST", PROTOCOLS[server].generate_path, handler)])


def ask(server, response, *, status=200, params=None, **generate_kwargs):
    """Serve `response` as `server` and return the client's result for one call."""

    async def handler(request):
        await request.read()
        return web.json_response(response, status=status)

    async def main():
        runner, url = await serve(server, handler)
        try:
            async with RemoteGenerateClient(
                url, server=server, **RECORDED["client"], transport_config=TransportConfig(retries=0)
            ) as client:
                return await client.generate(PROMPT, params or {}, return_routed_experts=True, **generate_kwargs)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


# -- item 21: weight-version spans ---------------------------------------------------------


@pytest.mark.parametrize(("server", "name"), [("sglang", "sglang_weight_versions"), ("vllm", "vllm_weight_versions")])
def test_weight_version_spans_are_exposed_and_weight_version_is_the_newest(server, name):
    result = ask(server, recorded(name))
    assert result.weight_versions == SPANS
    assert result.weight_version == "step-8"  # vLLM reported None before
    np.testing.assert_array_equal(result.routed_experts, ROUTES)


def test_a_single_vllm_span_gives_the_weight_version():
    parsed = parse("vllm", recorded("vllm_one_weight_version"))
    assert parsed.weight_versions == (WeightVersionSpan("step-9", 0, 3),) and parsed.weight_version == "step-9"


def test_an_answer_without_spans_has_none():
    raw = recorded("vllm_weight_versions")
    del raw["choices"][0]["weight_versions"]
    parsed = parse("vllm", raw)
    assert parsed.weight_versions == () and parsed.weight_version is None


@pytest.mark.parametrize(
    ("spans", "words"),
    [
        ("step-7", "expected a list"),
        ([{"version": 7, "start": 0, "end": 3}], r"weight_versions\[0\].version"),
        ([{"version": "a", "start": 0}], r"weight_versions\[0\].end is missing"),
        ([{"version": "a", "start": 2, "end": 1}], "start <= end"),
        ([{"version": "a", "start": -1, "end": 1}], "start <= end"),
        ([{"version": "a", "start": 0, "end": 4}], "3 generated tokens"),
        ([{"version": "a", "start": 1, "end": 3}, {"version": "b", "start": 0, "end": 1}], "in order"),
        ([{"version": "a", "start": True, "end": 3}], r"weight_versions\[0\].start"),
    ],
)
def test_malformed_spans_are_a_wire_format_error(spans, words):
    raw = recorded("vllm_weight_versions")
    raw["choices"][0]["weight_versions"] = spans
    with pytest.raises(WireFormatError, match=words):
        parse("vllm", raw)


def test_the_trace_refuses_a_turn_whose_tokens_span_two_versions_naming_them():
    result = ask("vllm", recorded("vllm_weight_versions"))
    trace = RoutedExpertTrace(num_layers=3, topk=2)
    with pytest.raises(ValueError, match=r"turn 0: .*'step-7' \(tokens 0\.\.0\).*'step-8' \(tokens 1\.\.2\)"):
        trace.record(
            prompt_len=4,
            generated_len=3,
            routes=result.routed_experts,
            weight_version=result.weight_version,
            weight_versions=result.weight_versions,
        )
    assert trace.turns == 0


def test_a_trace_that_allows_mixed_versions_accepts_the_turn():
    trace = RoutedExpertTrace(num_layers=3, topk=2, allow_mixed_versions=True)
    trace.record(prompt_len=4, generated_len=3, routes=ROUTES.astype(np.uint8), weight_versions=SPANS)
    assert trace.weight_versions == ("step-8",)


def test_a_one_version_span_is_the_turns_version_and_conflicts_with_another_turns():
    trace = RoutedExpertTrace(num_layers=3, topk=2)
    one = (WeightVersionSpan("step-9", 0, 3),)
    trace.record(prompt_len=4, generated_len=3, routes=ROUTES.astype(np.uint8), weight_versions=one)
    assert trace.weight_versions == ("step-9",)
    with pytest.raises(ValueError, match="'step-10'.*'step-9'"):
        trace.record(prompt_len=10, generated_len=1, routes=ROUTES[:4].astype(np.uint8), weight_version="step-10")
    with pytest.raises(ValueError, match="weight_version 'x' is not the version of its spans"):
        RoutedExpertTrace().record(
            prompt_len=4, generated_len=3, routes=ROUTES.astype(np.uint8), weight_version="x", weight_versions=one
        )


# -- item 22: n > 1 -------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["torch_r3", "sglang", "vllm"])
def test_n_above_one_is_refused_before_sending(server):
    async def main():
        async with RemoteGenerateClient(
            "http://127.0.0.1:9", server=server, num_layers=3, topk=2, transport_config=TransportConfig(retries=0)
        ) as c:
            await c.generate([1, 2], {"n": 2}, return_routed_experts=True)

    with pytest.raises(ValueError, match=r"sampling_params\['n'\] = 2.*one sample per call"):
        asyncio.run(main())


def test_n_of_one_is_passed_on():
    parsed = PROTOCOLS["sglang"].request_body(GenerateCall(PROMPT, {"n": 1}, True))
    assert parsed["sampling_params"] == {"n": 1}


def test_sglangs_list_answer_for_n_above_one_is_named_as_such():
    with pytest.raises(WireFormatError, match=r"a JSON list of 2 outputs.*n > 1"):
        parse("sglang", recorded("sglang_n2"))


# -- item 23: SGLang's null log-prob ---------------------------------------------------------


def test_sglangs_null_logprob_reads_as_nan_and_keeps_the_answer():
    result = ask("sglang", recorded("sglang_null_logprob"))
    assert result.response_logprobs[0] == -0.25 and math.isnan(result.response_logprobs[1])
    np.testing.assert_array_equal(result.routed_experts, ROUTES)


# -- item 17: impossible log-probs and token ids ---------------------------------------------


@pytest.mark.parametrize(("server", "name"), [("sglang", "sglang_null_logprob"), ("vllm", "vllm_weight_versions")])
@pytest.mark.parametrize("value", [math.inf, 0.5, 1e-3])
def test_a_positive_or_infinite_logprob_is_refused_naming_the_field(server, name, value):
    raw = recorded(name)
    if server == "sglang":
        raw["meta_info"]["output_token_logprobs"][1][0] = value
        where = r"meta_info.output_token_logprobs\[1\]\[0\]"
    else:
        raw["choices"][0]["logprobs"]["content"][1]["logprob"] = value
        where = r"choices\[0\].logprobs.content\[1\].logprob"
    with pytest.raises(WireFormatError, match=where + r": expected a log-probability \(<= 0\)"):
        parse(server, raw)


def test_a_zero_or_minus_infinite_logprob_is_accepted():
    raw = recorded("vllm_weight_versions")
    raw["choices"][0]["logprobs"]["content"][0]["logprob"] = 0.0
    raw["choices"][0]["logprobs"]["content"][1]["logprob"] = -math.inf
    assert parse("vllm", raw).response_logprobs[:2] == (0.0, -math.inf)


@pytest.mark.parametrize("bad", [2**63, 2**64 + 5, -1])
def test_a_response_token_id_outside_int64_or_negative_is_refused(bad):
    raw = recorded("vllm_weight_versions")
    raw["choices"][0]["token_ids"][2] = bad
    with pytest.raises(WireFormatError, match=r"choices\[0\].token_ids\[2\].*\[0, 2\*\*63\)"):
        parse("vllm", raw)


@pytest.mark.parametrize("prompt", [[1, 2**63], [1, -1], np.array([1, 2**63], dtype=np.uint64)])
def test_a_prompt_token_id_outside_int64_or_negative_is_refused_before_sending(prompt):
    async def main():
        async with RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(retries=0)) as client:
            await client.generate(prompt, {})

    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\].*\[0, 2\*\*63\)"):
        asyncio.run(main())


# -- item 14: raw keeps the answer, not its route payload -------------------------------------


@pytest.mark.parametrize(("server", "name"), [("sglang", "sglang_weight_versions"), ("vllm", "vllm_weight_versions")])
def test_raw_holds_the_answer_without_its_route_payload(server, name):
    response = recorded(name)
    result = ask(server, response)
    if server == "sglang":
        assert "routed_experts" not in result.raw["meta_info"]
        response["meta_info"].pop("routed_experts")
    else:
        assert "routed_experts" not in result.raw["choices"][0]
        response["choices"][0].pop("routed_experts")
    assert result.raw == response  # everything else as the server sent it


# -- item 24: vLLM's cache_salt rules ---------------------------------------------------------


@pytest.mark.parametrize("salt", ["x" * 129, "ckpt/step_100", "a@b", "a\\b", "a\x00b"])
def test_a_salt_vllm_would_refuse_is_refused_at_construction_and_at_call(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        RemoteGenerateClient("http://127.0.0.1:9", server="vllm", cache_salt=salt)

    async def main():
        async with RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(retries=0)) as client:
            await client.generate([1, 2], {}, cache_salt=salt)

    with pytest.raises(ValueError, match="cache_salt"):
        asyncio.run(main())


def test_a_128_character_salt_is_accepted():
    assert RemoteGenerateClient("http://127.0.0.1:9", server="vllm", cache_salt="v" * 128).cache_salt == "v" * 128


# -- item 28: a wrong base_url or server says what was tried ------------------------------------


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "http://h:1/gw/v1"])
def test_an_openai_style_base_url_is_refused_with_the_fix(base_url):
    with pytest.raises(ValueError, match=r"ends in /v1.*server root.*without /v1"):
        RemoteGenerateClient(base_url, server="vllm")


@pytest.mark.parametrize("server", ["torch_r3", "sglang", "vllm"])
def test_a_404_names_the_url_tried_and_what_to_check(server):
    async def main():
        app = web.Application()  # no route at all: every path is a bare 404
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with RemoteGenerateClient(
                url, server=server, num_layers=3, topk=2, transport_config=TransportConfig(retries=0)
            ) as client:
                with pytest.raises(RemoteGenerateError) as info:
                    await client.generate(PROMPT, {}, return_routed_experts=True)
                return client.url, info.value
        finally:
            await runner.cleanup()

    tried, error = asyncio.run(main())
    message = str(error)
    assert error.status == 404 and tried in message and "HTTP 404" in message
    assert f"server={server!r}" in message and "base_url" in message
    if server == "vllm":
        assert "--enable-scale-out" in message


def test_an_ignored_start_is_logged_as_a_fallback(caplog):
    raw = recorded("sglang_weight_versions")  # every row from 0, although the call asks from 2
    with caplog.at_level(logging.WARNING, logger="torch_r3"):
        parsed = PROTOCOLS["sglang"].parse_response(raw, GenerateCall(PROMPT, {}, True, 2), LIMITS)
    np.testing.assert_array_equal(parsed.routed_experts, ROUTES[2:])
    [record] = [r for r in caplog.records if r.name.startswith("torch_r3.rollout.protocols")]
    assert "ignored" in record.getMessage() and "routed_experts_start_len" in record.getMessage()
