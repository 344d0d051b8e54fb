"""torch_r3.testing: any ServedModel plugs in; each protocol answers as its real server does; the prefix cache keeps routes; faults."""

from __future__ import annotations

import asyncio
import base64
import doctest
import importlib
import io
import json

import numpy as np
import pytest

from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError
from torch_r3.rollout.transport import TransportConfig
from torch_r3.testing import GenerateOutput, LoopbackServer, ServedModel, TinyMoELM
from torch_r3.testing._engine import PrefixCache

FAST = {"transport_config": TransportConfig(retries=3, backoff=0.01, max_backoff=0.05, timeout=20.0)}


class CountingModel(ServedModel):
    """Generates prompt[-1] + 1, +2, ...; token t at position j is routed to (j % E, (j + 1) % E)."""

    num_layers, num_experts, topk = 3, 300, 2

    def __init__(self, broken: bool = False):
        self.broken = broken

    def generate(self, token_ids, sampling_params):
        n = sampling_params.get("max_new_tokens", 2)
        ids = [token_ids[-1] + i + 1 for i in range(n)]
        rows = len(token_ids) + n - 1 - (1 if self.broken else 0)
        pos = np.arange(rows)[:, None, None]
        routes = np.broadcast_to(np.concatenate([pos, pos + 1], axis=2) % self.num_experts, (rows, 3, 2))
        return GenerateOutput(
            token_ids=ids, logprobs=[0.0] * n, routes=np.ascontiguousarray(routes), finish_reason="length"
        )


def _call(url, *args, **kwargs):
    async def main():
        async with RemoteGenerateClient(url, **FAST) as client:
            return await client.generate(*args, **kwargs)

    return asyncio.run(main())


def test_a_custom_served_model_plugs_in():
    with LoopbackServer(CountingModel()) as server:
        prompt = list(range(299))
        result = _call(
            server.url, prompt, {"max_new_tokens": 3}, return_routed_experts=True, routed_experts_prompt_start=250
        )
    assert list(result.response_ids) == [299, 300, 301]
    rows = np.arange(250, 299 + 3 - 1)
    expected = np.stack([rows % 300, (rows + 1) % 300], axis=1)[:, None, :].repeat(3, axis=1)
    assert result.routed_experts.dtype == np.int16  # ids up to 299 do not fit uint8
    np.testing.assert_array_equal(result.routed_experts, expected)


def test_a_model_returning_the_wrong_row_count_is_a_500():
    with (
        LoopbackServer(CountingModel(broken=True)) as server,
        pytest.raises(
            RemoteGenerateError, match=r"HTTP 500: model returned routes of shape \(3, 3, 2\), expected \(4, 3, 2\)"
        ),
    ):
        _call(server.url, [1, 2], {"max_new_tokens": 3}, return_routed_experts=True)


def test_only_served_models_are_accepted():
    with pytest.raises(TypeError, match="ServedModel"):
        LoopbackServer(object())


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"token_ids": []}, "at least one token"),
        ({"token_ids": [1], "sampling_params": {"top_q": 1}}, "unsupported sampling_params ['top_q']"),
        ({"token_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be an int >= 1"),
        (
            {"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 3}, "return_routed_experts": True},
            "in [0, 2]",
        ),
        ({"token_ids": [1], "sampling_params": {"routed_experts_prompt_start": 0}}, "requires return_routed_experts"),
        ({"token_ids": "abc"}, "token_ids must be a list of ints"),
        ({"prompt": [1]}, "missing 'token_ids'"),
    ],
)
def test_the_server_answers_bad_requests_with_400_and_a_json_error(body, words):
    import aiohttp

    async def main(url):
        async with aiohttp.ClientSession() as session, session.post(url + "/v1/generate", json=body) as response:
            return response.status, await response.json()

    with LoopbackServer() as server:
        status, payload = asyncio.run(main(server.url))
    assert status == 400 and words in payload["error"]["message"]


def test_async_mode_runs_on_the_current_loop_and_restarts_on_the_same_port():
    async def main():
        async with LoopbackServer() as server:
            port = server.port
            async with RemoteGenerateClient(server.url, **FAST) as client:
                first = await client.generate([1, 2], {"max_new_tokens": 2})
                await server.arestart(downtime=0.05)
                second = await client.generate([1, 2], {"max_new_tokens": 2})
            return port, server.port, first, second

    port, port_after, first, second = asyncio.run(main())
    assert port == port_after and first.response_ids == second.response_ids


@pytest.mark.parametrize(
    "module",
    [
        "torch_r3.rollout.codec",
        "torch_r3.rollout.trace",
        "torch_r3.rollout.client",
        "torch_r3.testing",
        "torch_r3.testing.model",
        "torch_r3.testing.server",
        "torch_r3.testing._engine",
        "torch_r3.testing.faults",
        "torch_r3.testing._wire",
        "torch_r3.testing._wire.vllm",
    ],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


# -- the three protocols at the raw HTTP level -----------------------------------
#
# Each check below is written from the servers' documented response fields and
# decodes the payloads with base64/NumPy directly, never with torch_r3.rollout.codec, and
# compares with the same seeded model run in-process.

PATHS = {"torch_r3": "/v1/generate", "sglang": "/generate", "vllm": "/inference/v1/generate"}


def _post(url, path, body):
    import aiohttp

    async def main():
        async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
            text = await response.text()
            return response.status, text

    status, text = asyncio.run(main())
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _request(protocol, prompt, max_new, *, start=0, salt=None):
    """The body each server expects for a routes-returning generate call."""
    if protocol == "sglang":
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_new},
            "return_logprob": True,
            "return_routed_experts": True,
            "routed_experts_start_len": start,
        }
        if salt is not None:
            body["extra_key"] = salt
        return body
    if protocol == "vllm":
        params = {"max_tokens": max_new, "logprobs": 1, "routed_experts_prompt_start": start}
        body = {"token_ids": prompt, "sampling_params": params, "return_token_ids": True}
    else:
        params = {"max_new_tokens": max_new, "routed_experts_prompt_start": start}
        body = {"token_ids": prompt, "sampling_params": params, "return_routed_experts": True}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _routes(protocol, payload, num_layers, topk):
    """The route array of a 200 body, decoded by hand from each server's documented encoding."""
    if protocol == "sglang":
        raw = base64.b64decode(payload["meta_info"]["routed_experts"])
        return np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, topk)
    routes = payload["choices"][0]["routed_experts"]
    if protocol == "vllm":
        return np.load(io.BytesIO(base64.b64decode(routes)), allow_pickle=False)
    data = np.frombuffer(base64.b64decode(routes["data"]), dtype=np.dtype(routes["dtype"]).newbyteorder("<"))
    return data.reshape(routes["shape"])


def _token_ids(protocol, payload):
    return payload["output_ids"] if protocol == "sglang" else payload["choices"][0]["token_ids"]


def test_sglang_answers_generate_with_its_fields_and_raw_int32_routes_from_the_start():
    prompt, start = [3, 1, 4, 1, 5, 9], 2
    ref = TinyMoELM().generate(prompt, {"max_new_tokens": 4})
    with LoopbackServer(protocol="sglang") as server:
        status, payload = _post(server.url, "/generate", _request("sglang", prompt, 4, start=start))
    assert status == 200
    assert payload["output_ids"] == ref.token_ids and isinstance(payload["text"], str)
    meta = payload["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (6, 4, 0)
    assert meta["output_token_logprobs"] == [[lp, t, None] for lp, t in zip(ref.logprobs, ref.token_ids)]
    assert meta["weight_version"] == "0" and "routed_experts_dtype" not in meta
    raw = base64.b64decode(meta["routed_experts"], validate=True)
    assert len(raw) == (6 + 4 - 1 - start) * 2 * 2 * 4  # rows [start, P+O-1), 2 layers, top-2, int32
    np.testing.assert_array_equal(np.frombuffer(raw, "<i4").reshape(-1, 2, 2), ref.routes[start:])


def test_sglang_with_ignored_start_returns_every_row_like_0_5_10_post1():
    prompt = [3, 1, 4, 1, 5, 9]
    ref = TinyMoELM().generate(prompt, {"max_new_tokens": 3})
    with LoopbackServer(protocol="sglang", sglang_ignores_start=True) as server:
        status, payload = _post(server.url, "/generate", _request("sglang", prompt, 3, start=4))
    assert status == 200
    np.testing.assert_array_equal(_routes("sglang", payload, 2, 2), ref.routes)  # rows from 0, not 4
    assert _routes("sglang", payload, 2, 2).shape[0] == len(prompt) + 3 - 1


def test_sglang_narrowed_routes_announce_their_dtype():
    prompt = [7, 8, 9]
    ref = TinyMoELM().generate(prompt, {"max_new_tokens": 2})
    with LoopbackServer(protocol="sglang", sglang_routes_dtype="uint8") as server:
        _, payload = _post(server.url, "/generate", _request("sglang", prompt, 2, start=1))
    meta = payload["meta_info"]
    assert meta["routed_experts_dtype"] == "uint8"
    np.testing.assert_array_equal(
        np.frombuffer(base64.b64decode(meta["routed_experts"]), np.uint8).reshape(-1, 2, 2), ref.routes[1:]
    )


def test_sglang_stop_finish_reason_names_the_matched_token():
    prompt = [3, 1, 4]
    first = TinyMoELM().generate(prompt, {"max_new_tokens": 3}).token_ids
    with LoopbackServer(protocol="sglang") as server:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "stop_token_ids": [first[1]]}}
        _, payload = _post(server.url, "/generate", body)
    assert payload["output_ids"] == first[:2]
    assert payload["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[1]}
    assert "routed_experts" not in payload["meta_info"] and "output_token_logprobs" not in payload["meta_info"]


def test_vllm_answers_with_a_npy_per_choice_and_its_fields():
    prompt, start = [3, 1, 4, 1, 5, 9], 3
    ref = TinyMoELM().generate(prompt, {"max_new_tokens": 4})
    with LoopbackServer(protocol="vllm") as server:
        body = _request("vllm", prompt, 4, start=start)
        body["return_routed_experts"] = False  # no per-request switch: ignored, as vLLM ignores it
        status, payload = _post(server.url, "/inference/v1/generate", body)
    assert status == 200
    choice = payload["choices"][0]
    assert choice["token_ids"] == ref.token_ids and choice["finish_reason"] == "length"
    assert [c["token_id"] for c in choice["logprobs"]["content"]] == ref.token_ids
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == ref.logprobs
    assert payload["prompt_token_ids"] == prompt
    assert payload["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    raw = base64.b64decode(choice["routed_experts"], validate=True)
    assert raw[:6] == b"\x93NUMPY"  # a .npy file, header included
    routes = np.load(io.BytesIO(raw), allow_pickle=False)
    assert routes.dtype == np.uint8 and routes.shape == (6 + 4 - 1 - start, 2, 2)
    np.testing.assert_array_equal(routes, ref.routes[start:])


def test_vllm_routes_are_uint16_above_256_experts():
    with LoopbackServer(CountingModel(), protocol="vllm") as server:
        _, payload = _post(
            server.url, "/inference/v1/generate", {"token_ids": list(range(299)), "sampling_params": {"max_tokens": 2}}
        )
    routes = np.load(io.BytesIO(base64.b64decode(payload["choices"][0]["routed_experts"])), allow_pickle=False)
    assert routes.dtype == np.uint16 and routes.shape == (300, 3, 2)
    assert routes[:, 0, 1].tolist() == [(j + 1) % 300 for j in range(300)]


def test_the_torch_r3_format_reports_its_weight_version_and_vllm_reports_none():
    with LoopbackServer() as server:
        _, before = _post(server.url, "/v1/generate", _request("torch_r3", [1, 2, 3], 2))
        server.update_weights()
        _, after = _post(server.url, "/v1/generate", _request("torch_r3", [1, 2, 3], 2))
    assert (before["weight_version"], after["weight_version"]) == ("0", "1")
    with LoopbackServer(protocol="vllm") as server:
        _, payload = _post(server.url, "/inference/v1/generate", _request("vllm", [1, 2, 3], 2))
    assert "weight_version" not in payload and "weight_version" not in payload["choices"][0]


@pytest.mark.parametrize("protocol", ["torch_r3", "sglang", "vllm"])
def test_dense_layers_come_back_as_zero_rows_over_every_hidden_layer(protocol):
    model = TinyMoELM(num_layers=3, first_k_dense=1, num_experts=8, topk=2)
    ref = TinyMoELM(num_layers=3, first_k_dense=1, num_experts=8, topk=2).generate([5, 6, 7], {"max_new_tokens": 3})
    with LoopbackServer(model, protocol=protocol) as server:
        _, payload = _post(server.url, PATHS[protocol], _request(protocol, [5, 6, 7], 3))
    routes = _routes(protocol, payload, 3, 2)
    assert routes.shape == (5, 3, 2)
    assert not routes[:, 0].any()  # the dense layer
    assert all(len(set(row)) == 2 for row in routes[:, 1:].reshape(-1, 2).tolist())  # MoE layers: two distinct experts
    np.testing.assert_array_equal(routes, ref.routes)


def test_model_info_names_the_moe_layers():
    with LoopbackServer(TinyMoELM(num_layers=4, first_k_dense=2)) as server:
        import aiohttp

        async def main():
            async with aiohttp.ClientSession() as session, session.get(server.url + "/v1/model_info") as response:
                return await response.json()

        info = asyncio.run(main())
    assert info == {"num_layers": 4, "num_experts": 8, "topk": 2, "moe_layers": [2, 3]}


# -- the stale-route hazard (issue 13) -------------------------------------------

SALT_FIELD = {"torch_r3": "cache_salt", "vllm": "cache_salt", "sglang": "extra_key"}


@pytest.mark.parametrize("protocol", ["torch_r3", "sglang", "vllm"])
def test_after_a_weight_update_a_cached_prefix_returns_stale_routes_unless_salted_by_version(protocol):
    prompt = [(7 * i + 3) % 64 for i in range(21)]  # one 16-token vLLM block, plus a tail
    old = TinyMoELM().generate(prompt, {"max_new_tokens": 2}).routes
    fresh_model = TinyMoELM()
    fresh_model.update_weights(1)
    fresh = fresh_model.generate(prompt, {"max_new_tokens": 2}).routes
    with LoopbackServer(protocol=protocol) as server:
        block = server.engine.cache.block_size
        hit = (len(prompt) - 1) // block * block  # the cache never covers the last prompt token
        _post(server.url, PATHS[protocol], _request(protocol, prompt, 2))
        version = server.update_weights(flush_cache=False)
        _, unsalted = _post(server.url, PATHS[protocol], _request(protocol, prompt, 2))
        _, salted = _post(server.url, PATHS[protocol], _request(protocol, prompt, 2, salt=f"v{version}"))
    stale = _routes(protocol, unsalted, 2, 2)
    assert hit > 0 and (stale[:hit] != fresh[:hit]).any()  # differs from a fresh computation ...
    np.testing.assert_array_equal(stale[:hit], old[:hit])  # ... because it is the old policy's
    np.testing.assert_array_equal(stale[hit:], fresh[hit:])
    np.testing.assert_array_equal(_routes(protocol, salted, 2, 2), fresh)


@pytest.mark.parametrize(("protocol", "path"), [("sglang", "/flush_cache"), ("vllm", "/reset_prefix_cache")])
def test_flushing_the_cache_after_a_weight_update_gives_fresh_routes(protocol, path):
    prompt = list(range(20))
    fresh_model = TinyMoELM()
    fresh_model.update_weights(1)
    fresh = fresh_model.generate(prompt, {"max_new_tokens": 2}).routes
    with LoopbackServer(protocol=protocol) as server:
        _post(server.url, PATHS[protocol], _request(protocol, prompt, 2))
        server.update_weights(flush_cache=False)
        status, _ = _post(server.url, path, {})
        _, payload = _post(server.url, PATHS[protocol], _request(protocol, prompt, 2))
    assert status == 200
    np.testing.assert_array_equal(_routes(protocol, payload, 2, 2), fresh)


def test_sglang_weight_updates_flush_the_radix_cache_by_default_and_report_the_version():
    prompt = list(range(10))
    fresh_model = TinyMoELM()
    fresh_model.update_weights(1)
    fresh = fresh_model.generate(prompt, {"max_new_tokens": 2}).routes
    with LoopbackServer(protocol="sglang") as server:
        _, first = _post(server.url, "/generate", _request("sglang", prompt, 2))
        _, cached = _post(server.url, "/generate", _request("sglang", prompt, 2))
        server.update_weights()
        _, after = _post(server.url, "/generate", _request("sglang", prompt, 2))
    assert first["meta_info"]["cached_tokens"] == 0
    assert cached["meta_info"]["cached_tokens"] == len(prompt) - 1  # token-granular radix match, last token recomputed
    assert (after["meta_info"]["cached_tokens"], after["meta_info"]["weight_version"]) == (0, "1")
    np.testing.assert_array_equal(_routes("sglang", after, 2, 2), fresh)


@pytest.mark.parametrize("protocol", ["torch_r3", "vllm"])
def test_an_empty_cache_salt_is_refused_with_400(protocol):
    with LoopbackServer(protocol=protocol) as server:
        status, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2], 1, salt=""))
    assert status == 400 and "cache_salt must be a non-empty string" in payload["error"]["message"]


# -- faults, per protocol --------------------------------------------------------


@pytest.mark.parametrize("protocol", ["torch_r3", "sglang", "vllm"])
def test_an_aborted_request_has_no_tokens_and_no_routes(protocol):
    with LoopbackServer(protocol=protocol) as server:
        server.faults.abort()
        status, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2, 3], 2))
    assert status == 200 and _token_ids(protocol, payload) == []
    if protocol == "sglang":
        assert payload["meta_info"]["finish_reason"]["type"] == "abort" and "routed_experts" not in payload["meta_info"]
    else:
        choice = payload["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["routed_experts"] is None


@pytest.mark.parametrize("protocol", ["torch_r3", "sglang", "vllm"])
def test_a_malformed_route_payload_disagrees_with_its_size(protocol):
    with LoopbackServer(protocol=protocol) as server:
        server.faults.malformed()
        status, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2, 3], 2))
    assert status == 200
    if protocol == "sglang":
        assert len(base64.b64decode(payload["meta_info"]["routed_experts"])) % (2 * 2 * 4) != 0
    elif protocol == "vllm":
        with pytest.raises(ValueError):
            np.load(io.BytesIO(base64.b64decode(payload["choices"][0]["routed_experts"])), allow_pickle=False)
    else:
        envelope = payload["choices"][0]["routed_experts"]
        assert (
            len(base64.b64decode(envelope["data"])) != np.prod(envelope["shape"]) * np.dtype(envelope["dtype"]).itemsize
        )


@pytest.mark.parametrize("protocol", ["torch_r3", "sglang", "vllm"])
def test_status_truncate_and_disconnect_faults_apply_to_every_protocol(protocol):
    import aiohttp

    with LoopbackServer(protocol=protocol) as server:
        server.faults.status(503, message="overloaded")
        server.faults.truncate()
        server.faults.disconnect()
        status, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2], 1))
        assert status == 503 and payload["error"]["message"] == "overloaded"
        status, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2], 1))
        assert status == 200 and isinstance(payload, str)  # half a JSON document
        with pytest.raises(aiohttp.ClientError):
            _post(server.url, PATHS[protocol], _request(protocol, [1, 2], 1))
        status, _ = _post(server.url, PATHS[protocol], _request(protocol, [1, 2], 1))
        assert status == 200 and server.stats.requests == 4 and server.faults.pending == 0


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_server_without_the_routes_flag_sends_no_routes(protocol):
    with LoopbackServer(protocol=protocol, routes_enabled=False) as server:
        _, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2, 3], 2))
    assert len(_token_ids(protocol, payload)) == 2
    if protocol == "sglang":
        assert "routed_experts" not in payload["meta_info"]
    else:
        assert payload["choices"][0]["routed_experts"] is None


@pytest.mark.parametrize(
    ("protocol", "body", "words"),
    [
        (
            "sglang",
            {"input_ids": [1, 2], "routed_experts_start_len": 3, "return_routed_experts": True},
            "routed_experts_start_len must be an int in [0, 2]",
        ),
        ("sglang", {"input_ids": [1], "cache_salt": "v1"}, "unknown request fields ['cache_salt']"),
        ("sglang", {"text": "hi"}, "missing 'input_ids'"),
        (
            "sglang",
            {"input_ids": [1], "sampling_params": {"max_tokens": 2}},
            "unsupported sampling_params ['max_tokens']",
        ),
        (
            "vllm",
            {"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 3}},
            "routed_experts_prompt_start must be an int in [0, 2]",
        ),
        ("vllm", {"token_ids": [1], "sampling_params": {"n": 2}}, "n must be an int in [1, 1]"),
        (
            "vllm",
            {"token_ids": [1], "sampling_params": {"max_new_tokens": 2}},
            "unsupported sampling_params ['max_new_tokens']",
        ),
        ("vllm", {"token_ids": [1], "cache_salt": 5}, "cache_salt must be a string"),
    ],
)
def test_sglang_and_vllm_answer_bad_requests_with_400_naming_the_field(protocol, body, words):
    with LoopbackServer(protocol=protocol) as server:
        status, payload = _post(server.url, PATHS[protocol], body)
    assert status == 400 and words in payload["error"]["message"]


def test_the_prefix_cache_shares_blocks_only_within_one_salt_and_whole_prefix():
    cache = PrefixCache(block_size=2, max_blocks=100)
    routes = np.arange(6 * 1 * 1).reshape(6, 1, 1)
    cache.store("a", [1, 2, 3, 4, 5, 6, 7], routes)
    # Reference: the longest run of whole blocks of prompt[:-1] equal to the stored prefix, same salt.
    for salt, prompt in [
        ("a", [1, 2, 3, 4, 5, 6, 7]),
        ("a", [1, 2, 3, 9, 5, 6]),
        ("b", [1, 2, 3, 4]),
        ("a", [1, 2]),
        ("a", [9, 2, 3]),
    ]:
        same = 0
        while same < min(len(prompt) - 1, 6) and prompt[same] == [1, 2, 3, 4, 5, 6, 7][same]:
            same += 1
        expected = same // 2 * 2 if salt == "a" else 0
        hit, cached = cache.match(salt, prompt)
        assert hit == expected
        if hit:
            np.testing.assert_array_equal(cached, routes[:hit])


def test_the_prefix_cache_is_bounded():
    cache = PrefixCache(block_size=1, max_blocks=3)
    cache.store(None, list(range(10)), np.zeros((9, 1, 1), np.int64))
    assert len(cache) == 3


def test_a_sglang_prefill_only_request_returns_p_minus_1_rows_and_no_tokens():
    prompt = [3, 1, 4, 1, 5]
    ref = TinyMoELM().generate(prompt, {"max_new_tokens": 1})
    with LoopbackServer(protocol="sglang") as server:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_routed_experts": True}
        status, payload = _post(server.url, "/generate", body)
    assert status == 200 and payload["output_ids"] == []
    assert payload["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    routes = _routes("sglang", payload, 2, 2)
    assert routes.shape[0] == len(prompt) - 1  # [0, P + O - 1) with O = 0
    np.testing.assert_array_equal(routes, ref.routes[: len(prompt) - 1])


def test_unknown_protocols_and_misplaced_options_are_refused_at_construction():
    with pytest.raises(
        ValueError,
        match=r"protocol must be one of \['megatron', 'sglang', 'sglang-openai', 'skyrl', 'torch_r3', 'vllm', 'vllm-openai'\], got 'openai'",
    ):
        LoopbackServer(protocol="openai")
    with pytest.raises(ValueError, match="apply to protocol='sglang', not 'vllm'"):
        LoopbackServer(protocol="vllm", sglang_ignores_start=True)
    with pytest.raises(NotImplementedError, match="CountingModel does not implement update_weights"):
        LoopbackServer(CountingModel()).update_weights()


# -- the shapes of the released servers (issue 19 items 21-24), end to end --------------------


class MinusInfModel(TinyMoELM):
    """A TinyMoELM whose second generated token has log-probability -inf."""

    def generate(self, token_ids, sampling_params):
        out = super().generate(token_ids, sampling_params)
        logprobs = list(out.logprobs)
        logprobs[1] = float("-inf")
        return GenerateOutput(out.token_ids, logprobs, out.routes, out.finish_reason)


def _client_call(url, server, *args, **kwargs):
    async def main():
        async with RemoteGenerateClient(url, server=server, num_layers=2, topk=2, **FAST) as client:
            return await client.generate(*args, **kwargs)

    return asyncio.run(main())


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_sglang_and_vllm_report_weight_version_spans_and_the_client_exposes_them(protocol):
    from torch_r3.rollout.protocols import WeightVersionSpan

    with LoopbackServer(protocol=protocol) as server:
        _, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2, 3], 3))
        server.update_weights(weight_version="step-2")
        params = {"max_new_tokens": 3} if protocol == "sglang" else {"max_tokens": 3}
        result = _client_call(server.url, protocol, [1, 2, 3], params, return_routed_experts=True)
    spans = (
        payload["meta_info"]["weight_versions"] if protocol == "sglang" else payload["choices"][0]["weight_versions"]
    )
    assert spans == [{"version": "0", "start": 0, "end": 3}]
    assert result.weight_versions == (WeightVersionSpan("step-2", 0, 3),) and result.weight_version == "step-2"


def test_sglang_answers_n_above_one_with_a_json_list_which_the_client_never_asks_for():
    with LoopbackServer(protocol="sglang") as server:
        body = _request("sglang", [1, 2, 3], 2)
        body["sampling_params"]["n"] = 2
        status, payload = _post(server.url, "/generate", body)
        with pytest.raises(ValueError, match=r"sampling_params\['n'\] = 2"):
            _client_call(server.url, "sglang", [1, 2, 3], {"max_new_tokens": 2, "n": 2}, return_routed_experts=True)
        requests = server.stats.requests
    assert status == 200 and isinstance(payload, list) and len(payload) == 2
    assert all(set(p) == {"text", "output_ids", "meta_info"} for p in payload)
    assert all(_routes("sglang", p, 2, 2).shape == (4, 2, 2) for p in payload)
    assert requests == 1  # the client's n=2 call was refused before sending


def test_sglang_writes_a_minus_inf_logprob_as_null_and_the_client_reads_nan_keeping_the_routes():
    import math

    with LoopbackServer(MinusInfModel(), protocol="sglang") as server:
        _, payload = _post(server.url, "/generate", _request("sglang", [1, 2, 3], 3))
        result = _client_call(server.url, "sglang", [1, 2, 3], {"max_new_tokens": 3}, return_routed_experts=True)
    assert payload["meta_info"]["output_token_logprobs"][1][0] is None
    assert math.isnan(result.response_logprobs[1]) and math.isfinite(result.response_logprobs[0])
    assert result.routed_experts.shape == (5, 2, 2)


@pytest.mark.parametrize("salt", ["ckpt/step_100", "a@b", "x" * 129])
def test_vllm_refuses_a_salt_over_128_characters_or_with_a_forbidden_character_with_400(salt):
    with LoopbackServer(protocol="vllm") as server:
        status, payload = _post(server.url, PATHS["vllm"], _request("vllm", [1, 2], 1, salt=salt))
        ok, _ = _post(server.url, PATHS["vllm"], _request("vllm", [1, 2], 1, salt="ckpt-step_100"))
    assert status == 400 and "cache_salt" in payload["error"]["message"] and ok == 200


def _field(payload, path: str):
    """`meta_info.weight_version` or `choices[0].weight_versions` looked up in a JSON answer."""
    for part in path.split("."):
        name, _, index = part.partition("[")
        payload = payload[name]
        if index:
            payload = payload[int(index.rstrip("]"))]
    return payload


@pytest.mark.parametrize("protocol", ["torch_r3", "sglang", "vllm"])
def test_the_api_pages_weight_version_column_is_the_field_each_protocols_answer_carries(protocol):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "api" / "testing.md").read_text()
    table = page[page.index("| weight version reported |") :].split("\n\n")[0]
    (row,) = [line for line in table.splitlines() if line.startswith(f'| `"{protocol}"` |')]
    cell = row.split("|")[3]
    fields = re.findall(r"`([\w.\[\]]+)`", cell)
    assert fields, f"the {protocol} row names no weight-version field: {cell.strip()!r}"
    with LoopbackServer(protocol=protocol) as server:
        server.update_weights(weight_version="step-2")
        _, payload = _post(server.url, PATHS[protocol], _request(protocol, [1, 2, 3], 2))
    for path in fields:
        value = _field(payload, path)
        assert "step-2" in (value, *(span["version"] for span in value if isinstance(value, list))), (path, value)
