"""Large route payloads decode on the decode pool, off the event loop, and come out the same.

A real aiohttp server on 127.0.0.1 answers SGLang `/generate` and vLLM bodies;
the client reads their route text in place and decodes it on a `torch_r3-decode`
thread while its loop keeps running callbacks. Small payloads stay on the loop.
Large routes are health-checked there too, but for `health="warn"` (its warning
points at the caller).
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import numpy as np
import pytest
from aiohttp import web

from tests.http_stub import serve_routes
from torch_r3.health.check import RouteHealthCheck, RouteHealthError, RouteHealthWarning
from torch_r3.rollout import _offload
from torch_r3.rollout.client import RemoteGenerateClient, TransportConfig
from torch_r3.rollout.protocols import PROTOCOLS

LAYERS, TOPK = 4, 2


def sglang_body(rows: int, generated: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    routes = np.random.default_rng(seed).integers(0, 300, (rows, LAYERS, TOPK))
    text = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    body = {
        "output_ids": list(range(generated)),
        "meta_info": {"finish_reason": {"type": "length"}, "routed_experts": text, "weight_version": "7"},
    }
    return body, routes


def vllm_body(rows: int, generated: int) -> tuple[dict, np.ndarray]:
    routes = np.random.default_rng(1).integers(0, 256, (rows, LAYERS, TOPK)).astype(np.uint8)
    buf = io.BytesIO()
    np.save(buf, routes, allow_pickle=False)
    choice = {"token_ids": list(range(generated)), "finish_reason": "length"}
    return {"choices": [{**choice, "routed_experts": base64.b64encode(buf.getvalue()).decode()}]}, routes


async def generate(server: str, body: dict, prompt_len: int, generated: int):
    async def handler(request):
        await request.read()
        return web.json_response(body)

    path = PROTOCOLS[server].generate_path
    runner, url = await serve_routes([("POST", path, handler)])
    try:
        async with RemoteGenerateClient(
            url, server=server, num_layers=LAYERS, topk=TOPK, transport_config=TransportConfig(retries=0)
        ) as client:
            params = {"max_new_tokens": generated} if server == "sglang" else {"max_tokens": generated}
            return await client.generate(list(range(prompt_len)), params, return_routed_experts=True)
    finally:
        await runner.cleanup()


@pytest.fixture
def decoded_on(monkeypatch):
    """Records the thread each `parse_response` runs on, and whether the loop ran a callback meanwhile."""
    seen: list[tuple[str, bool]] = []

    def watch(server: str):
        kind = type(PROTOCOLS[server])
        original = kind.parse_response
        loop = asyncio.get_running_loop()

        def parse_response(self, raw, call, limits):
            name = threading.current_thread().name
            served = threading.Event()
            if name.startswith("torch_r3-decode"):
                # The loop is free while we decode: a callback scheduled from here runs.
                loop.call_soon_threadsafe(served.set)
                served.wait(timeout=30)
            seen.append((name, served.is_set()))
            return original(self, raw, call, limits)

        # On the class: undoing the patch then restores the method it inherits.
        monkeypatch.setattr(kind, "parse_response", parse_response)

    return watch, seen


@pytest.mark.parametrize("server,make", [("sglang", sglang_body), ("vllm", vllm_body)])
def test_a_large_payload_decodes_on_the_pool_while_the_loop_keeps_serving(decoded_on, server, make):
    watch, seen = decoded_on
    rows = _offload.OFFLOAD_BYTES // (LAYERS * TOPK) + 100  # past the threshold for uint8 (vLLM) too
    body, routes = make(rows, generated=11)

    async def main():
        watch(server)
        return await generate(server, body, prompt_len=rows - 10, generated=11)

    result = asyncio.run(main())
    [(thread, served)] = seen
    assert thread.startswith("torch_r3-decode") and served
    np.testing.assert_array_equal(result.routed_experts, routes)
    assert "routed_experts" not in (result.raw.get("meta_info") or result.raw["choices"][0])


def test_a_small_payload_decodes_on_the_loops_own_thread(decoded_on):
    watch, seen = decoded_on
    body, routes = sglang_body(rows=20, generated=5)

    async def main():
        watch("sglang")
        return await generate("sglang", body, prompt_len=16, generated=5), threading.current_thread().name

    result, loop_thread = asyncio.run(main())
    assert seen == [(loop_thread, False)]
    np.testing.assert_array_equal(result.routed_experts, routes)


def test_responses_in_flight_decode_on_as_many_pool_threads_as_cpus():
    # Each decode waits until all of them have started: they can only all finish if they run at once.
    workers = _offload.decode_workers()
    if workers < 2:
        pytest.skip("one usable CPU: the pool has one thread")
    barrier = threading.Barrier(2, timeout=30)
    kind = type(PROTOCOLS["sglang"])
    original = kind.parse_response
    threads: list[str] = []

    def parse_response(self, raw, call, limits):
        threads.append(threading.current_thread().name)
        barrier.wait()
        return original(self, raw, call, limits)

    rows = _offload.OFFLOAD_BYTES // (4 * LAYERS * TOPK) + 10
    bodies = [sglang_body(rows, generated=3, seed=s) for s in (1, 2)]

    async def main():
        return await asyncio.gather(*(generate("sglang", b, prompt_len=rows - 2, generated=3) for b, _ in bodies))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kind, "parse_response", parse_response)
        results = asyncio.run(main())
    assert len(set(threads)) == 2 and all(t.startswith("torch_r3-decode") for t in threads)
    for result, (_, routes) in zip(results, bodies):
        np.testing.assert_array_equal(result.routed_experts, routes)


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_large_routes_are_health_checked_on_the_pool_and_warn_mode_on_the_loop(monkeypatch, mode):
    threads: list[str] = []
    original = RouteHealthCheck.check

    def check(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RouteHealthCheck, "check", check)
    rows = _offload.OFFLOAD_BYTES // (LAYERS * TOPK) + 100  # uint8 routes past the threshold
    body, routes = vllm_body(rows, generated=11)
    broken = routes.copy()
    broken[:40] = 0  # rows zero in every layer: refused (or warned about) wherever the check runs
    buf = io.BytesIO()
    np.save(buf, broken, allow_pickle=False)
    bad = {"choices": [{**body["choices"][0], "routed_experts": base64.b64encode(buf.getvalue()).decode()}]}

    async def main():
        loop_thread = threading.current_thread().name
        path = PROTOCOLS["vllm"].generate_path
        handler_body = iter([body, bad])

        async def handler(request):
            await request.read()
            return web.json_response(next(handler_body))

        runner, url = await serve_routes([("POST", path, handler)])
        try:
            async with RemoteGenerateClient(
                url,
                server="vllm",
                num_layers=LAYERS,
                topk=TOPK,
                health=mode,
                transport_config=TransportConfig(retries=0),
            ) as client:
                good = await client.generate(list(range(rows - 10)), {"max_tokens": 11}, return_routed_experts=True)
                if mode == "raise":
                    with pytest.raises(RouteHealthError, match="rows 0..39 of"):
                        await client.generate(list(range(rows - 10)), {"max_tokens": 11}, return_routed_experts=True)
                else:
                    with pytest.warns(RouteHealthWarning, match="rows 0..39 of"):
                        await client.generate(list(range(rows - 10)), {"max_tokens": 11}, return_routed_experts=True)
                return good, loop_thread, client.health.stats
        finally:
            await runner.cleanup()

    good, loop_thread, stats = asyncio.run(main())
    np.testing.assert_array_equal(good.routed_experts, routes)
    assert good.health_checked and stats.trajectories == 2 and stats.zero_rows == 1
    if mode == "raise":
        assert len(threads) == 2 and all(t.startswith("torch_r3-decode") for t in threads)
    else:
        assert threads == [loop_thread, loop_thread]
