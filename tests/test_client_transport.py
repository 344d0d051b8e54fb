"""The client and its transport under hostile or broken servers: every failure is one
error type (`RemoteGenerateError`) naming the URL, memory bounded by bytes received, bodies
read under a cap, no redirect followed, delays bounded, `429`/`503` with `Retry-After`
retried, retries visible in logging; and the base URL, cache salt and session options checked.

Every server is a real `aiohttp.web` application on 127.0.0.1; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import time
import tracemalloc

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from tests.http_stub import client_kwargs_of, serve_routes
from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError, TransportConfig
from torch_r3.rollout.codec import encode_routes
from torch_r3.rollout.protocols.native import GENERATE_PATH
from torch_r3.rollout.transport import parse_retry_after

FAST = {"retries": 3, "backoff": 0.01, "max_backoff": 0.05, "timeout": 20.0}


def ok_body(token_ids=(5, 6), routes=None, **extra) -> dict:
    choice = {"token_ids": list(token_ids), "finish_reason": "length", "logprobs": None, "routed_experts": routes}
    return {"choices": [choice], **extra}


def generate_result(handler, **client_kwargs):
    async def main():
        runner, url = await serve_routes([("POST", GENERATE_PATH, handler)])
        try:
            async with RemoteGenerateClient(url, **client_kwargs_of(client_kwargs, **FAST)) as client:
                return await client.generate([1, 2, 3], {"max_new_tokens": 2})
        finally:
            await runner.cleanup()

    return asyncio.run(main())


# -- item 10: memory grows with the bytes that arrived, never with a declared size --------


def test_a_stalled_body_declaring_256_mib_does_not_make_the_client_allocate_it():
    declared = 256 << 20

    async def main():
        release = asyncio.Event()

        async def handler(request):
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = declared
            await response.prepare(request)
            await response.write(b'{"choices": ')  # then stall until the client has given up
            await release.wait()
            return response

        runner, url = await serve_routes([("POST", GENERATE_PATH, handler)])
        try:
            async with RemoteGenerateClient(
                url, transport_config=TransportConfig(retries=0, timeout=1.0, max_response_bytes=512 << 20)
            ) as client:
                tracemalloc.start()
                try:
                    with pytest.raises(RemoteGenerateError, match="TimeoutError"):
                        await client.generate([1, 2, 3], {"max_new_tokens": 2})
                    return tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
        finally:
            release.set()
            await runner.cleanup()

    peak = asyncio.run(main())
    # Measured: a 256 MiB peak before the fix (a bytearray of the declared length).
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB while {declared >> 20} MiB were only declared"


def test_a_body_arriving_in_pieces_is_read_whole_and_parsed():
    import json

    text = json.dumps(ok_body(token_ids=range(3000))).encode()

    async def handler(request):
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(text)
        await response.prepare(request)
        for i in range(0, len(text), 1000):
            await response.write(text[i : i + 1000])
        return response

    assert generate_result(handler).response_ids == tuple(range(3000))


# -- item 11: a redirect of the POST is an error, never followed --------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_an_error_naming_the_url_and_the_location_and_is_not_followed(status):
    elsewhere = []

    async def other(request):
        elsewhere.append((request.method, dict(request.headers), await request.read()))
        return web.json_response(ok_body())

    async def main():
        other_runner, other_url = await serve_routes([("*", GENERATE_PATH, other)])
        location = other_url + GENERATE_PATH

        async def handler(request):
            await request.read()
            return web.Response(status=status, headers={"Location": location})

        runner, url = await serve_routes([("POST", GENERATE_PATH, handler)])
        try:
            async with RemoteGenerateClient(
                url, transport_config=TransportConfig(**FAST, headers={"X-Api-Key": "secret"})
            ) as client:
                with pytest.raises(RemoteGenerateError) as info:
                    await client.generate([1, 2, 3], {"max_new_tokens": 2})
            return url, location, info.value
        finally:
            await runner.cleanup()
            await other_runner.cleanup()

    url, location, error = asyncio.run(main())
    assert elsewhere == []  # neither the body nor the X-Api-Key went to the other origin
    assert error.status == status and error.attempts == 1
    message = str(error)
    assert url + GENERATE_PATH in message and location in message and f"HTTP {status}" in message
    assert "redirect" in message and "base_url" in message


# -- item 13: delays are bounded -----------------------------------------------------------


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0])
@pytest.mark.parametrize("name", ["backoff", "max_backoff"])
def test_an_unbounded_or_negative_backoff_is_refused(name, value):
    with pytest.raises(ValueError, match=name):
        TransportConfig(**{name: value})
    with pytest.raises(ValueError, match=name):
        RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(**{name: value}))


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0, 0.0])
@pytest.mark.parametrize("name", ["timeout", "connect_timeout"])
def test_an_infinite_timeout_is_refused_in_favour_of_none(name, value):
    with pytest.raises(ValueError, match=name):
        TransportConfig(**{name: value})


def test_a_retry_after_past_max_backoff_is_capped_at_max_backoff():
    config = TransportConfig(backoff=1.0, max_backoff=3.0)
    assert config.delay(1, retry_after="1000000000") == 3.0
    assert config.delay(1, retry_after="9" * 400) == 3.0  # float() would say inf


# -- item 15: a malformed Retry-After never escapes as a bare ValueError ------------------


@pytest.mark.parametrize("header", ["\u00b3", "\u0663", "\uff11", "1\u00b2", " 7 \u00b3"])
def test_a_retry_after_of_non_ascii_digits_is_unusable_not_an_error(header):
    assert header.strip()[:1].isdigit() or header[-1].isdigit()  # what str.isdigit() accepts
    assert parse_retry_after(header) is None
    delay = TransportConfig(backoff=1.0, max_backoff=10.0).delay(1, retry_after=header)
    assert 0.5 <= delay <= 1.0  # the ordinary backoff


def test_a_superscript_retry_after_on_a_503_is_retried_with_the_ordinary_backoff():
    calls = []

    async def handler(request):
        calls.append(await request.read())
        if len(calls) == 1:
            return web.json_response({"error": {"message": "busy"}}, status=503, headers={"Retry-After": "\u00b3"})
        return web.json_response(ok_body())

    assert generate_result(handler).response_ids == (5, 6) and len(calls) == 2


# -- item 28: retries are visible through logging, silent by default -----------------------


def test_retries_are_logged_on_the_torch_r3_transport_logger(caplog):
    calls = []

    async def handler(request):
        calls.append(await request.read())
        if len(calls) < 3:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return web.json_response(ok_body())

    with caplog.at_level(logging.DEBUG, logger="torch_r3"):
        generate_result(handler)
    retries = [r for r in caplog.records if r.name == "torch_r3.rollout.transport" and "retry" in r.getMessage()]
    assert len(retries) == 2 and all(r.levelno == logging.WARNING for r in retries)
    assert "HTTP 503: busy" in retries[0].getMessage() and GENERATE_PATH in retries[0].getMessage()


def test_the_package_logger_is_silent_by_default():
    import torch_r3

    handlers = logging.getLogger("torch_r3").handlers
    assert torch_r3 is not None and any(isinstance(h, logging.NullHandler) for h in handlers)


# == RemoteGenerateClient against hostile or broken servers ==


async def serve(handler, path=GENERATE_PATH, method="POST"):
    """Start `handler` on a free port; returns (runner, base_url)."""
    return await serve_routes([(method, path, handler)])


def run_against(handler, call, *, path=GENERATE_PATH, client_kwargs=None):
    """Serve `handler`, build a client for it and await `call(client)`."""

    async def main():
        runner, url = await serve(handler, path)
        try:
            async with RemoteGenerateClient(url, **client_kwargs_of(client_kwargs or {}, **FAST)) as client:
                return url, await call(client)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def generate_against(handler, *, client_kwargs=None, **kwargs):
    return run_against(
        handler, lambda c: c.generate([1, 2, 3], {"max_new_tokens": 2}, **kwargs), client_kwargs=client_kwargs
    )


# -- base_url is checked at construction -------------------------------------------


@pytest.mark.parametrize(
    ("base_url", "words"),
    [
        ("http://", "no host"),
        ("https:///v1", "no host"),
        ("http://127.0.0.1:8000/?token=1", "query"),
        ("http://127.0.0.1:8000/#frag", "fragment"),
        ("http://user:secret@127.0.0.1:8000", "credentials"),
        ("http://127.0.0.1:99999", "port"),
        ("ftp://127.0.0.1", "http:// or https://"),
    ],
)
def test_a_bad_base_url_is_rejected_at_construction(base_url, words):
    with pytest.raises(ValueError, match=words) as info:
        RemoteGenerateClient(base_url)
    if "secret" in base_url:
        assert "secret" not in str(info.value)


def test_a_base_url_with_a_path_prefix_keeps_it():
    client = RemoteGenerateClient("http://127.0.0.1:8000/gateway/llm/")
    assert client.url == "http://127.0.0.1:8000/gateway/llm/v1/generate"


# -- every failure is a RemoteGenerateError naming the URL -------------------------------


def test_deeply_nested_json_is_a_remote_generate_error():
    async def handler(request):
        await request.read()
        return web.Response(body=b"[" * 200_000 + b"]" * 200_000, content_type="application/json")

    with pytest.raises(RemoteGenerateError, match="nested too deeply") as info:
        generate_against(handler)
    assert GENERATE_PATH in str(info.value) and info.value.attempts == 1


def test_a_deeply_nested_error_body_still_names_the_status():
    async def handler(request):
        return web.Response(body=b'{"error":' * 100_000, status=400, content_type="application/json")

    with pytest.raises(RemoteGenerateError, match="HTTP 400") as info:
        generate_against(handler)
    assert info.value.status == 400


def test_a_redirect_loop_is_a_remote_generate_error():
    async def handler(request):
        raise web.HTTPTemporaryRedirect(location=GENERATE_PATH)

    with pytest.raises(RemoteGenerateError, match="redirect") as info:
        generate_against(handler)
    assert GENERATE_PATH in str(info.value)


def test_a_declared_body_over_the_cap_is_refused_before_reading():
    seen = {}

    async def handler(request):
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 50 << 20
        await response.prepare(request)
        sent = 0
        try:
            while sent < 50 << 20:
                await response.write(b" " * (1 << 20))
                sent += 1 << 20
        except (ConnectionError, RuntimeError):
            pass
        seen["sent"] = sent
        return response

    with pytest.raises(RemoteGenerateError, match=r"max_response_bytes=1048576") as info:
        generate_against(handler, client_kwargs={"max_response_bytes": 1 << 20})
    assert "Content-Length 52428800" in str(info.value) and info.value.attempts == 1


def test_a_chunked_body_over_the_cap_stops_reading_early():
    seen = {"sent": 0}
    total = 200 << 20

    async def handler(request):
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            while seen["sent"] < total:
                await response.write(b" " * (1 << 20))
                seen["sent"] += 1 << 20
        except (ConnectionError, RuntimeError):
            pass
        return response

    with pytest.raises(RemoteGenerateError, match=r"more than max_response_bytes=2097152"):
        generate_against(handler, client_kwargs={"max_response_bytes": 2 << 20})
    # The client hung up long before the 200 MiB were sent (socket buffers
    # account for the slack).
    assert seen["sent"] < total // 2


def test_a_compressed_body_is_capped_by_its_decompressed_size():
    import gzip

    bomb = gzip.compress(b" " * (64 << 20))  # 64 MiB of JSON whitespace in ~64 KiB

    async def handler(request):
        await request.read()
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    assert len(bomb) < 1 << 20
    with pytest.raises(RemoteGenerateError, match=r"more than max_response_bytes=1048576"):
        generate_against(handler, client_kwargs={"max_response_bytes": 1 << 20})


def test_a_route_envelope_declaring_terabytes_is_a_remote_generate_error():
    envelope = {"data": "AAAA", "shape": [10**6, 1000, 1000], "dtype": "int32"}

    async def handler(request):
        await request.read()
        return web.json_response(ok_body(routes=envelope))

    with pytest.raises(RemoteGenerateError, match="routed_experts") as info:
        generate_against(handler, return_routed_experts=True)
    assert GENERATE_PATH in str(info.value)


def test_max_response_bytes_is_validated():
    with pytest.raises(ValueError, match="max_response_bytes"):
        RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(max_response_bytes=0))
    with pytest.raises(TypeError, match="max_response_bytes"):
        RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(max_response_bytes=1.5))


@pytest.mark.parametrize(
    ("params", "error", "words"),
    [
        ({"max_new_tokens": np.int64(2)}, TypeError, "int64 is not JSON serializable"),
        ({"temperature": float("nan")}, ValueError, "not JSON compliant"),
    ],
)
def test_sampling_params_json_cannot_carry_are_refused_before_sending(params, error, words):
    async def main():
        async with RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(retries=0)) as client:
            await client.generate([1], params)

    with pytest.raises(error, match=words) as info:
        asyncio.run(main())
    assert "the request body cannot be sent as JSON" in str(info.value)


# -- 429 / 503 and Retry-After ----------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
def test_too_many_requests_and_unavailable_with_retry_after_are_retried(status):
    calls = []

    async def handler(request):
        calls.append(await request.json())
        if len(calls) < 3:
            return web.json_response({"error": {"message": "busy"}}, status=status, headers={"Retry-After": "0"})
        return web.json_response(ok_body())

    _, result = generate_against(handler)
    assert list(result.response_ids) == [5, 6] and len(calls) == 3
    assert calls[0] == calls[1] == calls[2]  # the same request re-sent


def test_429_past_the_budget_names_the_status_and_the_servers_message():
    async def handler(request):
        return web.json_response({"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "0"})

    with pytest.raises(RemoteGenerateError, match="last cause: HTTP 429: slow down") as info:
        generate_against(handler, client_kwargs={"retries": 2})
    assert info.value.status == 429 and info.value.attempts == 3


@pytest.mark.parametrize(
    ("header", "expected"),
    [("3", 3.0), ("0", 0.0), ("120", 10.0), ("-5", None), ("soon", None), (None, None), ("1.5", None)],
)
def test_retry_after_seconds_are_honoured_within_max_backoff(header, expected):
    config = TransportConfig(backoff=1.0, max_backoff=10.0)
    delay = config.delay(1, retry_after=header)
    if expected is None:  # unusable header: the ordinary backoff
        assert 0.5 <= delay <= 1.0
    else:
        assert delay == expected


def test_retry_after_as_an_http_date_is_honoured_within_max_backoff():
    config = TransportConfig(backoff=1.0, max_backoff=10.0)
    in_4s = email.utils.formatdate(time.time() + 4.5, usegmt=True)
    assert 2.0 <= config.delay(1, retry_after=in_4s) <= 4.5
    past = email.utils.formatdate(time.time() - 100, usegmt=True)
    assert config.delay(1, retry_after=past) == 0.0
    in_an_hour = email.utils.formatdate(time.time() + 3600, usegmt=True)
    assert config.delay(1, retry_after=in_an_hour) == 10.0


# -- the user's own session --------------------------------------------------------------


def test_a_users_session_is_used_and_never_closed():
    requests = []

    async def handler(request):
        requests.append(request.headers.get("X-From-Session"))
        await request.read()
        return web.json_response(ok_body())

    async def main():
        runner, url = await serve(handler)
        try:
            async with aiohttp.ClientSession(headers={"X-From-Session": "mine"}) as session:
                async with RemoteGenerateClient(
                    url, transport_config=TransportConfig(**FAST, session=session)
                ) as client:
                    result = await client.generate([1], {})
                assert not session.closed  # the client left it open
                async with RemoteGenerateClient(
                    url, transport_config=TransportConfig(**FAST, session=session)
                ) as again:
                    await again.generate([2], {})
                return result
        finally:
            await runner.cleanup()

    result = asyncio.run(main())
    assert list(result.response_ids) == [5, 6] and requests == ["mine", "mine"]


def test_a_closed_users_session_is_a_remote_generate_error():
    async def main():
        session = aiohttp.ClientSession()
        await session.close()
        async with RemoteGenerateClient(
            "http://127.0.0.1:9", transport_config=TransportConfig(session=session, retries=0)
        ) as client:
            await client.generate([1], {})

    with pytest.raises(RemoteGenerateError, match="session is closed"):
        asyncio.run(main())


def test_a_users_session_from_another_event_loop_is_a_remote_generate_error():
    import threading

    made, other = threading.Event(), {}

    def other_loop():
        loop = other["loop"] = asyncio.new_event_loop()

        async def make():
            other["session"] = aiohttp.ClientSession()

        loop.run_until_complete(make())
        made.set()
        loop.run_forever()

    thread = threading.Thread(target=other_loop, daemon=True)
    thread.start()
    made.wait(30)

    async def handler(request):
        return web.json_response(ok_body())

    try:
        with pytest.raises(RemoteGenerateError, match="use it on the event loop that created it") as info:
            generate_against(handler, client_kwargs={"session": other["session"]})
        assert GENERATE_PATH in str(info.value)
    finally:
        asyncio.run_coroutine_threadsafe(other["session"].close(), other["loop"]).result(30)
        other["loop"].call_soon_threadsafe(other["loop"].stop)
        thread.join(30)


def test_a_client_with_a_users_session_refuses_to_pickle():
    import pickle

    async def main():
        async with aiohttp.ClientSession() as session:
            client = RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(session=session))
            with pytest.raises(TypeError, match="session"):
                pickle.dumps(client)

    asyncio.run(main())


def test_session_and_connection_options_are_exclusive():
    async def main():
        async with aiohttp.ClientSession() as session:
            with pytest.raises(ValueError, match="trace_configs"):
                RemoteGenerateClient(
                    "http://127.0.0.1:9",
                    transport_config=TransportConfig(session=session, trace_configs=[aiohttp.TraceConfig()]),
                )

    asyncio.run(main())


def test_trace_configs_see_every_request():
    started = []

    async def on_start(session, context, params):
        started.append(str(params.url))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)

    async def handler(request):
        await request.read()
        return web.json_response(ok_body())

    url, _ = generate_against(handler, client_kwargs={"trace_configs": [trace]})
    assert started == [url + GENERATE_PATH]


# -- cache_salt ---------------------------------------------------------------------------


def _capture_bodies():
    bodies = []

    async def handler(request):
        bodies.append(await request.json())
        return web.json_response(ok_body())

    return bodies, handler


def test_cache_salt_is_sent_only_when_set_and_per_call_beats_the_default():
    bodies, handler = _capture_bodies()

    async def calls(client):
        await client.generate([1], {})
        await client.generate([1], {}, cache_salt="v7")

    run_against(handler, calls)
    run_against(handler, calls, client_kwargs={"cache_salt": "v3"})
    assert [b.get("cache_salt", "<absent>") for b in bodies] == ["<absent>", "v7", "v3", "v7"]


@pytest.mark.parametrize("salt", ["", 7, b"v1"])
def test_an_empty_or_non_string_cache_salt_is_refused_before_sending(salt):
    error = ValueError if salt == "" else TypeError
    with pytest.raises(error, match="cache_salt"):
        RemoteGenerateClient("http://127.0.0.1:9", cache_salt=salt)

    async def main():
        async with RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(retries=0)) as client:
            await client.generate([1], {}, cache_salt=salt)

    with pytest.raises(error, match="cache_salt"):
        asyncio.run(main())


def test_weight_version_comes_from_the_servers_answer():
    async def handler(request):
        await request.read()
        return web.json_response(ok_body(weight_version="v12"))

    _, result = generate_against(handler)
    assert result.weight_version == "v12"


def test_routes_decode_from_a_raw_server_too():
    routes = np.arange(4 * 2 * 2).reshape(4, 2, 2) % 7
    body = json.dumps(ok_body(routes=encode_routes(routes)))

    async def handler(request):
        await request.read()
        return web.Response(text=body, content_type="application/json")

    _, result = generate_against(handler, return_routed_experts=True)
    np.testing.assert_array_equal(result.routed_experts, routes)


@pytest.mark.parametrize("where", ["routes", "elsewhere"])
def test_a_body_with_a_raw_control_character_in_a_string_is_not_json(where):
    # json.loads refuses a raw tab inside a string; so must the client, wherever the string sits.
    text = json.dumps(ok_body(routes=encode_routes(np.zeros((4, 1, 2), dtype=np.int64)), data="x"))
    if where == "routes":
        text = text.replace('"data": "', '"data": "\t', 1)
    else:
        text = text.replace('"data": "x"', '"data": "x\ty"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)

    async def handler(request):
        await request.read()
        return web.Response(text=text, content_type="application/json")

    with pytest.raises(RemoteGenerateError, match="not valid JSON.*Invalid control character"):
        generate_against(handler, return_routed_experts=True)


def test_the_transport_config_checks_its_connection_options_and_keeps_headers_out_of_its_repr():
    config = TransportConfig(headers={"Authorization": "Bearer s3cret"}, retries=1)
    assert "s3cret" not in repr(config) and "s3cret" not in repr(
        RemoteGenerateClient("http://h:1", transport_config=config)
    )
    assert config.headers == {"Authorization": "Bearer s3cret"} and hash(config) == hash(TransportConfig(retries=1))
    with pytest.raises(TypeError, match=r"headers\['a'\] must map a string to a string, got int"):
        TransportConfig(headers={"a": 1})
    with pytest.raises(TypeError, match="session must be an aiohttp.ClientSession, got int"):
        TransportConfig(session=1)
