"""The transport under hostile servers: memory bounded by bytes received, no
redirect followed, delays bounded, one error type, retries visible in logging.

Every server is a real `aiohttp.web` application on 127.0.0.1; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import tracemalloc

import pytest
from aiohttp import web
from http_stub import serve_routes

from torch_r3.client import RemoteGenerateClient, RemoteGenerateError, TransportConfig
from torch_r3.protocols.native import GENERATE_PATH
from torch_r3.transport import parse_retry_after

FAST = {"retries": 3, "backoff": 0.01, "max_backoff": 0.05, "timeout": 20.0}


def ok_body(token_ids=(5, 6)) -> dict:
    choice = {"token_ids": list(token_ids), "finish_reason": "length", "logprobs": None, "routed_experts": None}
    return {"choices": [choice]}


def generate_against(handler, **client_kwargs):
    async def main():
        runner, url = await serve_routes([("POST", GENERATE_PATH, handler)])
        try:
            async with RemoteGenerateClient(url, **{**FAST, **client_kwargs}) as client:
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
            async with RemoteGenerateClient(url, retries=0, timeout=1.0, max_response_bytes=512 << 20) as client:
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

    assert generate_against(handler).response_ids == tuple(range(3000))


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
            async with RemoteGenerateClient(url, headers={"X-Api-Key": "secret"}, **FAST) as client:
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
        RemoteGenerateClient("http://127.0.0.1:9", **{name: value})


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

    assert generate_against(handler).response_ids == (5, 6) and len(calls) == 2


# -- item 28: retries are visible through logging, silent by default -----------------------


def test_retries_are_logged_on_the_torch_r3_transport_logger(caplog):
    calls = []

    async def handler(request):
        calls.append(await request.read())
        if len(calls) < 3:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return web.json_response(ok_body())

    with caplog.at_level(logging.DEBUG, logger="torch_r3"):
        generate_against(handler)
    retries = [r for r in caplog.records if r.name == "torch_r3.transport" and "retry" in r.getMessage()]
    assert len(retries) == 2 and all(r.levelno == logging.WARNING for r in retries)
    assert "HTTP 503: busy" in retries[0].getMessage() and GENERATE_PATH in retries[0].getMessage()


def test_the_package_logger_is_silent_by_default():
    import torch_r3

    handlers = logging.getLogger("torch_r3").handlers
    assert torch_r3 is not None and any(isinstance(h, logging.NullHandler) for h in handlers)
