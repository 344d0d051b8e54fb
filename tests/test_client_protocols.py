"""The SGLang and vLLM protocols read recorded responses into the same canonical routes.

The fixtures in `tests/fixtures/` follow the servers' documented response
fields; each case stores the routes it must decode to as a plain nested list
(made by NumPy alone, see `make_fixtures.py`). Each case is read twice: by the
protocol directly, and end to end by `RemoteGenerateClient` from a real
`aiohttp.web` server on 127.0.0.1 that answers with the recorded body and
checks the request body the client sent.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.http_stub import client_kwargs_of
from torch_r3.health.check import RouteHealthCheck, RouteHealthError
from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError, TransportConfig, ZeroRoutesWarning
from torch_r3.rollout.codec import WireFormatError
from torch_r3.rollout.protocols import PROTOCOLS, GenerateCall, RouteLimits

FIXTURES = Path(__file__).parent / "fixtures"
CASES = {server: json.loads((FIXTURES / f"{server}_generate.json").read_text()) for server in ("sglang", "vllm")}
ALL = [(server, c) for server, cases in CASES.items() for c in cases]
FAST = {"retries": 0, "timeout": 20.0}


def by_name(server, name):
    return copy.deepcopy(next(c for c in CASES[server] if c["name"] == name))


def call_of(case, *, routes=True):
    return GenerateCall(case["call"]["prompt"], {}, routes, case["call"]["start"])


def limits_of(case, max_bytes=1 << 20):
    return RouteLimits(max_bytes=max_bytes, **case["client"])


def ask_recording(server, response, generate_args, client_kwargs, seen=None):
    """Serve `response` as `server` on 127.0.0.1 and return `client.generate(*generate_args)`."""

    async def handler(request):
        if seen is not None:
            seen.append(await request.json())
        return web.json_response(response)

    async def main():
        app = web.Application()
        app.router.add_post(PROTOCOLS[server].generate_path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with RemoteGenerateClient(url, server=server, **client_kwargs_of(client_kwargs, **FAST)) as client:
                return await client.generate(*generate_args[:2], **generate_args[2])
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def check_against_expected(result, expected):
    assert list(result.response_ids) == expected["response_ids"]
    if expected["response_logprobs"] is None:
        assert result.response_logprobs is None
    else:
        assert list(result.response_logprobs) == expected["response_logprobs"]
    assert result.finish_reason == expected["finish_reason"]
    assert result.weight_version == expected["weight_version"]
    if expected["routes"] is None:
        assert result.routed_experts is None
    else:
        reference = np.array(expected["routes"], dtype=np.int64)
        assert result.routed_experts.dtype in (np.uint8, np.int16, np.int32)
        assert result.routed_experts.flags.c_contiguous
        np.testing.assert_array_equal(result.routed_experts, reference)
        # The narrowest canonical dtype for the ids, by value.
        assert result.routed_experts.dtype == (np.uint8 if reference.max() < 256 else np.int16)


@pytest.mark.parametrize(("server", "case"), ALL, ids=[f"{s}-{c['name']}" for s, c in ALL])
def test_a_recorded_response_decodes_to_its_canonical_routes(server, case):
    parsed = PROTOCOLS[server].parse_response(case["response"], call_of(case), limits_of(case))
    check_against_expected(parsed, case["expected"])


@pytest.mark.parametrize("name", ["small", "wide", "start"])
def test_both_servers_recorded_answers_give_the_same_array(name):
    arrays = [
        PROTOCOLS[server].parse_response(c["response"], call_of(c), limits_of(c)).routed_experts
        for server in ("sglang", "vllm")
        for c in [by_name(server, name)]
    ]
    assert arrays[0].dtype == arrays[1].dtype
    np.testing.assert_array_equal(arrays[0], arrays[1])


def test_an_sglang_that_ignored_the_start_is_sliced_to_the_same_rows():
    honoured, ignored = by_name("sglang", "start"), by_name("sglang", "start_ignored")
    a = PROTOCOLS["sglang"].parse_response(honoured["response"], call_of(honoured), limits_of(honoured))
    b = PROTOCOLS["sglang"].parse_response(ignored["response"], call_of(ignored), limits_of(ignored))
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    assert b.routed_experts.base is None  # a copy: the rows before the start are freed


# -- end to end: the client against a server answering with the recording ---------------


def expected_request(server, case):
    prompt, start = case["call"]["prompt"], case["call"]["start"]
    if server == "sglang":
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "return_routed_experts": True,
        }
        if start:
            body["routed_experts_start_len"] = start
        return body
    params = {"max_tokens": 3, "logprobs": 1}
    if start:
        params["routed_experts_prompt_start"] = start
    return {"token_ids": prompt, "sampling_params": params, "return_token_ids": True}


@pytest.mark.parametrize(("server", "case"), ALL, ids=[f"{s}-{c['name']}" for s, c in ALL])
def test_the_client_sends_the_servers_fields_and_reads_the_recording(server, case):
    seen = []
    params = {"max_new_tokens": 3} if server == "sglang" else {"max_tokens": 3}
    kwargs = {"return_routed_experts": True, "routed_experts_prompt_start": case["call"]["start"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroRoutesWarning)  # dense layer 0 is all zero by design
        result = ask_recording(
            server,
            case["response"],
            (case["call"]["prompt"], params, kwargs),
            {"moe_layers": [1, 2], **case["client"]},
            seen,
        )
    assert seen == [expected_request(server, case)]
    check_against_expected(result, case["expected"])
    # raw is the answer as sent, without the route payload (decoded into routed_experts).
    stripped = copy.deepcopy(case["response"])
    (stripped["meta_info"] if server == "sglang" else stripped["choices"][0]).pop("routed_experts", None)
    assert result.raw == stripped


# -- damaged recordings -----------------------------------------------------------------


def _sglang_payload(case, array):
    case["response"]["meta_info"]["routed_experts"] = base64.b64encode(array.astype("<i4").tobytes()).decode()
    return case


def _vllm_payload(case, array, dtype=None):
    buf = io.BytesIO()
    np.save(buf, array if dtype is None else array.astype(dtype), allow_pickle=True)
    case["response"]["choices"][0]["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
    return case


def damaged():
    rows = np.array(by_name("sglang", "small")["expected"]["routes"])
    out = []
    c = by_name("sglang", "small")
    c["response"]["meta_info"]["routed_experts"] = c["response"]["meta_info"]["routed_experts"][:-8]
    out.append(("sglang", c, "not a whole number"))
    out.append(("sglang", _sglang_payload(by_name("sglang", "small"), rows[1:]), "need 6"))
    out.append(("sglang", _sglang_payload(by_name("sglang", "small"), np.where(rows == 3, -1, rows)), ">= 0"))
    out.append(("sglang", _sglang_payload(by_name("sglang", "small"), np.where(rows == 3, 8, rows)), "num_experts"))
    c = by_name("sglang", "small")
    c["response"]["meta_info"]["output_token_logprobs"][1][1] = 99
    out.append(("sglang", c, "is not output_ids[1]"))
    c = by_name("sglang", "small")
    del c["response"]["meta_info"]["routed_experts"]
    out.append(("sglang", c, "--enable-return-routed-experts"))
    c = by_name("sglang", "small")
    c["response"]["meta_info"]["weight_version"] = 3
    out.append(("sglang", c, "weight_version"))
    out.append(("vllm", _vllm_payload(by_name("vllm", "small"), rows.astype(object)), "npy"))
    out.append(("vllm", _vllm_payload(by_name("vllm", "small"), rows[:, :2]), "layers"))
    out.append(("vllm", _vllm_payload(by_name("vllm", "small"), rows, "float32"), "npy"))
    c = by_name("vllm", "small")
    c["response"]["choices"][0]["routed_experts"] = None
    out.append(("vllm", c, "--enable-return-routed-experts"))
    c = by_name("vllm", "small")
    c["response"]["choices"][0]["token_ids"] = [21, True, 23]
    out.append(("vllm", c, "token_ids[1]"))
    c = by_name("vllm", "small")
    c["response"]["choices"] = []
    out.append(("vllm", c, "choices is empty"))
    return out


@pytest.mark.parametrize(("server", "case", "words"), damaged(), ids=[f"{s}-{w}" for s, _, w in damaged()])
def test_a_damaged_recording_is_a_wire_format_error_naming_the_problem(server, case, words):
    with pytest.raises(WireFormatError) as info:
        PROTOCOLS[server].parse_response(case["response"], call_of(case), limits_of(case))
    assert words in str(info.value)


def test_a_payload_over_the_route_cap_is_refused_before_decoding():
    for server in ("sglang", "vllm"):
        case = by_name(server, "wide")
        with pytest.raises(WireFormatError, match="max_bytes|exceeds|cap"):
            PROTOCOLS[server].parse_response(case["response"], call_of(case), limits_of(case, max_bytes=16))


def test_an_all_zero_moe_layer_is_refused_naming_the_layer_and_the_vllm_setting():
    case = by_name("vllm", "small")
    rows = np.array(case["expected"]["routes"])
    rows[:, 2] = 0
    _vllm_payload(case, rows, "uint8")
    args = (case["call"]["prompt"], {"max_tokens": 3}, {"return_routed_experts": True})
    with pytest.raises(RouteHealthError, match=r"layer 2: rows 0\.\.5 of 6 are all zero.*--moe-backend triton"):
        ask_recording("vllm", case["response"], args, {"moe_layers": [1, 2], **case["client"]})


def test_health_warn_lets_an_all_zero_moe_layer_through_with_a_warning_and_counts_it():
    case = by_name("vllm", "small")
    rows = np.array(case["expected"]["routes"])
    rows[:, 2] = 0
    _vllm_payload(case, rows, "uint8")
    args = (case["call"]["prompt"], {"max_tokens": 3}, {"return_routed_experts": True})
    check = RouteHealthCheck("warn")
    with pytest.warns(ZeroRoutesWarning, match=r"layer 2: rows 0\.\.5 of 6 are all zero") as seen:
        result = ask_recording(
            "vllm", case["response"], args, {"moe_layers": [1, 2], "health": check, **case["client"]}
        )
    assert [w.filename for w in seen] == [__file__]  # attributed to the line that called generate
    np.testing.assert_array_equal(result.routed_experts, rows)  # warned, not altered
    assert (check.stats.zero_rows, check.stats.accepted_unhealthy, check.stats.refused) == (1, 1, 0)


def test_sglang_routes_need_the_model_shape_before_anything_is_sent():
    async def main():
        async with RemoteGenerateClient(
            "http://127.0.0.1:9", server="sglang", transport_config=TransportConfig(retries=0)
        ) as client:
            await client.generate([1, 2], {}, return_routed_experts=True)

    with pytest.raises(ValueError, match="num_layers= .*topk="):
        asyncio.run(main())


def test_sglang_has_no_model_field():
    with pytest.raises(ValueError, match="no model field"):
        PROTOCOLS["sglang"].request_body(GenerateCall([1], {}, False, model="m"))


@pytest.mark.parametrize(
    ("server", "field"), [("torch_r3", "cache_salt"), ("sglang", "extra_key"), ("vllm", "cache_salt")]
)
def test_the_salt_travels_in_each_servers_own_field_and_only_when_set(server, field):
    protocol = PROTOCOLS[server]
    salted = protocol.request_body(GenerateCall([1, 2], {}, True, 1, cache_salt="v4"))
    plain = protocol.request_body(GenerateCall([1, 2], {}, True, 1))
    assert salted[field] == "v4"
    assert {k: v for k, v in salted.items() if k != field} == plain
    assert "cache_salt" not in plain and "extra_key" not in plain
    with pytest.raises(ValueError, match="non-empty"):
        protocol.request_body(GenerateCall([1, 2], {}, True, 1, cache_salt=""))


# -- hostile JSON ---------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "token_ids",
                    "finish_reason",
                    "logprobs",
                    "routed_experts",
                    "output_ids",
                    "meta_info",
                    "output_token_logprobs",
                    "routed_experts_dtype",
                    "weight_version",
                    "content",
                    "token_id",
                    "logprob",
                    "type",
                    "data",
                    "shape",
                    "dtype",
                ]
            ),
            children,
            max_size=6,
        )
    ),
    max_leaves=40,
)


@pytest.mark.parametrize("server", ["torch_r3", "sglang", "vllm"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=JSON, start=st.integers(0, 2))
def test_random_json_raises_only_wire_format_error(server, raw, start):
    limits = RouteLimits(max_bytes=1 << 16, num_layers=2, topk=2, num_experts=8)
    try:
        PROTOCOLS[server].parse_response(raw, GenerateCall([1, 2], {}, True, start), limits)
    except WireFormatError:
        pass


def test_a_damaged_recording_through_the_client_is_a_remote_generate_error_naming_the_url():
    case = by_name("sglang", "small")
    case["response"]["output_ids"] = "abc"
    args = ([11, 12, 13, 14], {}, {"return_routed_experts": True})
    with pytest.raises(
        RemoteGenerateError, match=r"/generate: response breaks the sglang format: response.output_ids"
    ) as info:
        ask_recording("sglang", case["response"], args, case["client"])
    assert isinstance(info.value.__cause__, WireFormatError)
