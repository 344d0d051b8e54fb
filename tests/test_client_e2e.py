"""RemoteGenerateClient end to end against `LoopbackServer(protocol=...)`, for every protocol.

The server is real (aiohttp on 127.0.0.1) and serves a tiny MoE model whose
first layer is dense, so its answers carry every hidden layer with zero rows
for the dense one, as SGLang and vLLM send them. References come from an
identical model run in-process, never from the client under test.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.http_stub import client_kwargs_of
from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError
from torch_r3.rollout.protocols import SERVERS
from torch_r3.rollout.trace import RoutedExpertTrace
from torch_r3.routes import compact_routes
from torch_r3.testing import LoopbackServer, TinyMoELM

pytestmark = pytest.mark.filterwarnings("error::torch_r3.rollout.client.ZeroRoutesWarning")

# What not every server does: SkyRL reports no weight version; Megatron has no cache salt and no
# route start (every row comes back each turn) and reports integer epochs (tests/test_client_megatron.py).
NAMES_VERSIONS = [s for s in SERVERS if s not in ("skyrl", "megatron")]
TAKES_SALT = [s for s in SERVERS if s != "megatron"]
SHAPE = {"num_layers": 3, "num_experts": 8, "topk": 2, "first_k_dense": 1}
FAST = {"retries": 4, "backoff": 0.01, "max_backoff": 0.05, "timeout": 20.0}
REFERENCE = TinyMoELM(**SHAPE)


def model() -> TinyMoELM:
    return TinyMoELM(**SHAPE)


def client_for(server: LoopbackServer, **kwargs) -> RemoteGenerateClient:
    shape = {"num_layers": 3, "topk": 2, "num_experts": 8, "moe_layers": [1, 2]}
    return RemoteGenerateClient(server.url, server=server.protocol, **client_kwargs_of({**shape, **kwargs}, **FAST))


def params(protocol: str, n: int) -> dict:
    """`n` new tokens, greedy, in the server's own parameter name."""
    return {"max_new_tokens" if protocol in ("sglang", "torch_r3") else "max_tokens": n}


def reference(prompt, n):
    """What the loopback model generates for `prompt`: one independent model's greedy run, worked out
    once per (prompt, n) for every protocol's tests (the model is deterministic; callers only read)."""
    ids, logprobs, routes = _reference(tuple(prompt), n)
    return list(ids), list(logprobs), routes


@functools.cache
def _reference(prompt: tuple[int, ...], n: int):
    out = REFERENCE.generate(list(prompt), {"max_new_tokens": n})
    routes = compact_routes(out.routes)
    routes.setflags(write=False)
    return tuple(out.token_ids), tuple(out.logprobs), routes


def generate(server, prompt, n, client_kwargs=None, **kwargs):
    async def main():
        async with client_for(server, **(client_kwargs or {})) as client:
            return await client.generate(prompt, params(server.protocol, n), **kwargs)

    return asyncio.run(main())


@pytest.fixture(scope="module", params=SERVERS)
def server(request):
    with LoopbackServer(model(), protocol=request.param) as srv:
        srv.model.generate([1], {"max_new_tokens": 1})  # first torch call is slow; keep it out of timeouts
        yield srv


@pytest.fixture(autouse=True)
def _no_leftover_faults(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").faults.clear()


# -- single turn ------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, 3])
def test_one_turn_returns_the_models_tokens_logprobs_and_routes(server, start):
    prompt = [3, 14, 15, 9, 2, 6]
    result = generate(server, prompt, 4, return_routed_experts=True, routed_experts_prompt_start=start)
    ids, logprobs, routes = reference(prompt, 4)
    assert list(result.response_ids) == ids
    np.testing.assert_allclose(result.response_logprobs, logprobs)
    assert result.finish_reason == "length"
    assert result.routed_experts.shape == (len(prompt) + len(ids) - 1 - start, 3, 2)
    np.testing.assert_array_equal(result.routed_experts, routes[start:])
    assert not result.routed_experts[:, 0].any()  # the dense layer: zero rows, no warning
    expected_version = server.weight_version  # vLLM 0.32+ reports it too, in its weight_versions spans
    if server.protocol == "skyrl":
        expected_version = None  # SkyRL's endpoint reports none
    assert result.weight_version == expected_version


def test_routes_are_absent_unless_requested(server):
    result = generate(server, [1, 2], 2)
    assert result.routed_experts is None and list(result.response_ids) == reference([1, 2], 2)[0]


def test_an_sglang_prefill_only_request_returns_the_prompts_first_p_minus_1_rows():
    with LoopbackServer(model(), protocol="sglang") as srv:
        result = generate(srv, [5, 6, 7, 8], 0, return_routed_experts=True)
    _, routes = REFERENCE.forward([5, 6, 7, 8])
    assert result.response_ids == () and result.routed_experts.shape == (3, 3, 2)
    np.testing.assert_array_equal(result.routed_experts, compact_routes(routes.numpy()[:3]))


# -- multi-turn ---------------------------------------------------------------------------


def rollout(server, turns=5, *, trace=None, **client_kwargs):
    """A multi-turn rollout through the client; returns (conversation, routes)."""
    rng = np.random.default_rng(3)
    conversation = [11, 12, 13, 14]
    trace = trace if trace is not None else RoutedExpertTrace()

    async def main():
        nonlocal conversation
        async with client_for(server, **client_kwargs) as client:
            for turn in range(turns):
                result = await client.generate(
                    conversation,
                    params(server.protocol, 3),
                    return_routed_experts=True,
                    routed_experts_prompt_start=trace.prompt_start,
                )
                trace.record(
                    prompt_len=len(conversation),
                    generated_len=len(result.response_ids),
                    routes=result.routed_experts,
                    weight_version=result.weight_version,
                )
                conversation = conversation + list(result.response_ids)
                if turn < turns - 1:  # an observation (tool output) joins the conversation
                    conversation = conversation + rng.integers(0, 64, size=2).tolist()

    asyncio.run(main())
    return conversation, trace.finalize(token_count=len(conversation))


def test_five_turn_trace_equals_one_request_over_the_whole_conversation(server):
    rows0 = server.stats.route_rows
    conversation, routes = rollout(server)
    assert routes.shape == (len(conversation) - 1, 3, 2)
    if server.protocol == "megatron":  # no start field: every row comes back each turn, the client keeps the new ones
        assert server.stats.route_rows - rows0 > routes.shape[0]
    else:
        assert server.stats.route_rows - rows0 == routes.shape[0]  # each row sent once
    whole = generate(server, conversation[:-1], 1, return_routed_experts=True)
    assert list(whole.response_ids) == conversation[-1:]
    np.testing.assert_array_equal(routes, whole.routed_experts)
    np.testing.assert_array_equal(routes, reference(conversation[:-1], 1)[2])


@pytest.mark.parametrize(
    "options",
    [{"sglang_ignores_start": True}, {"sglang_routes_dtype": "uint16"}],
    ids=["0.5.10-ignores-start", "uint16"],
)
def test_sglang_variants_give_the_same_five_turn_trace(options):
    with LoopbackServer(model(), protocol="sglang", **options) as srv:
        rows0 = srv.stats.route_rows
        conversation, routes = rollout(srv)
        np.testing.assert_array_equal(routes, reference(conversation[:-1], 1)[2])
        if options.get("sglang_ignores_start"):  # every turn re-sent all rows; the client kept its own
            assert srv.stats.route_rows - rows0 > routes.shape[0]


def test_a_trace_widens_between_turns_when_ids_pass_255():
    # Seeded so that turn 1's ids all fit uint8 and turn 2 brings one past 255.
    wide = {**SHAPE, "num_experts": 300, "seed": 16}
    for protocol in ("sglang", "vllm"):
        trace, conversation, dtypes = RoutedExpertTrace(), [11, 12, 13, 14], []

        async def main(srv, protocol=protocol, trace=trace, dtypes=dtypes):
            nonlocal conversation
            async with client_for(srv, num_experts=300) as client:
                for _ in range(3):
                    result = await client.generate(
                        conversation,
                        params(protocol, 3),
                        return_routed_experts=True,
                        routed_experts_prompt_start=trace.prompt_start,
                    )
                    dtypes.append(result.routed_experts.dtype.name)
                    trace.record(prompt_len=len(conversation), generated_len=3, routes=result.routed_experts)
                    conversation = conversation + list(result.response_ids) + [5, 6]

        with LoopbackServer(TinyMoELM(**wide), protocol=protocol) as srv:
            asyncio.run(main(srv))
        routes = trace.finalize(token_count=len(conversation))
        expected = compact_routes(TinyMoELM(**wide).generate(conversation[:-3], {"max_new_tokens": 1}).routes)
        assert dtypes[:2] == ["uint8", "int16"] and routes.dtype == np.int16
        np.testing.assert_array_equal(routes, expected)


# -- load, restarts and faults -----------------------------------------------------------------


def test_200_concurrent_requests_are_all_correct(server):
    prompts = [[i % 64, (i * 7) % 64, (i // 64) + 1] for i in range(200)]

    async def main():
        async with client_for(server) as client:
            return await asyncio.gather(
                *(client.generate(p, params(server.protocol, 2), return_routed_experts=True) for p in prompts)
            )

    for prompt, result in zip(prompts, asyncio.run(main())):
        ids, _, routes = reference(prompt, 2)
        assert list(result.response_ids) == ids
        np.testing.assert_array_equal(result.routed_experts, routes)


@pytest.mark.parametrize("protocol", SERVERS)
def test_a_server_restart_during_a_run_loses_and_duplicates_nothing(protocol):
    with LoopbackServer(model(), protocol=protocol) as srv:
        srv.model.generate([1], {"max_new_tokens": 1})
        prompts = {f"r{i}": [i % 64, (3 * i) % 64] for i in range(30)}

        def restart_when_busy():
            while srv.stats.generations < 5:
                threading.Event().wait(0.005)
            srv.restart(downtime=0.3)

        restarter = threading.Thread(target=restart_when_busy)
        restarter.start()

        async def run():
            kwargs = {"retries": 12, "backoff": 0.05, "max_backoff": 0.2, "max_concurrency": 4}
            async with client_for(srv, **kwargs) as client:
                return await asyncio.gather(
                    *(
                        client.generate(p, params(protocol, 2), return_routed_experts=True, session_id=k)
                        for k, p in prompts.items()
                    )
                )

        results = asyncio.run(run())
        restarter.join()
        counts = collections.Counter(srv.stats.session_ids)
    assert counts == collections.Counter(list(prompts))  # every request served exactly once
    for prompt, result in zip(prompts.values(), results):
        np.testing.assert_array_equal(result.routed_experts, reference(prompt, 2)[2])


@pytest.mark.parametrize("fault", ["503", "429", "disconnect", "refuse"])
def test_transient_faults_are_retried_to_the_right_answer(server, fault):
    before = server.stats.requests
    if fault in ("503", "429"):
        server.faults.status(int(fault), n=2)
    elif fault == "disconnect":
        server.faults.disconnect()
    else:
        server.faults.refuse_connections(2)
    result = generate(server, [8, 9], 2, return_routed_experts=True)
    np.testing.assert_array_equal(result.routed_experts, reference([8, 9], 2)[2])
    assert server.stats.requests - before == {"503": 3, "429": 3, "disconnect": 2, "refuse": 1}[fault]


@pytest.mark.parametrize(("fault", "words"), [("malformed", "response breaks the"), ("truncate", "not valid JSON")])
def test_broken_answers_are_a_remote_generate_error_naming_the_url(server, fault, words):
    getattr(server.faults, fault)()
    with pytest.raises(RemoteGenerateError, match=words) as info:
        generate(server, [1, 2], 2, return_routed_experts=True)
    assert server.url in str(info.value) and info.value.attempts == 1


def test_an_aborted_request_is_reported_as_aborted_without_routes(server):
    server.faults.abort()
    result = generate(server, [1, 2, 3], 2, return_routed_experts=True)
    assert result.finish_reason == "abort" and result.routed_experts is None and result.response_ids == ()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_server_started_without_the_routes_flag_is_named_in_the_error(protocol):
    with (
        LoopbackServer(model(), protocol=protocol, routes_enabled=False) as srv,
        pytest.raises(RemoteGenerateError, match="--enable-return-routed-experts"),
    ):
        generate(srv, [1, 2], 2, return_routed_experts=True)


# -- weight updates and the prefix cache (issue 13) ----------------------------------------------


def stale_routes_scenario(protocol, salted: bool):
    """Routes of a cached prompt after a weight update, and the fresh reference."""
    ref = model()
    prompt = list(range(1, 41))  # longer than two cache blocks
    with LoopbackServer(model(), protocol=protocol, block_size=8) as srv:
        first = generate(srv, prompt, 2, return_routed_experts=True)
        version = srv.update_weights(flush_cache=False)
        salt = {"cache_salt": f"v{version}"} if salted else {}
        after = generate(srv, prompt, 2, return_routed_experts=True, **salt)
    ref.update_weights(1)
    fresh = compact_routes(ref.generate(prompt, {"max_new_tokens": 2}).routes)
    return first, after, fresh, version


@pytest.mark.parametrize("protocol", SERVERS)
def test_without_a_salt_a_cached_prefix_after_a_weight_update_returns_stale_routes(protocol):
    first, after, fresh, _ = stale_routes_scenario(protocol, salted=False)
    cached = 32  # whole blocks of 8, leaving the last prompt token to compute
    assert (after.routed_experts != fresh).any()  # the hazard: not what the new policy routes
    np.testing.assert_array_equal(after.routed_experts[:cached], first.routed_experts[:cached])


@pytest.mark.parametrize("protocol", TAKES_SALT)
def test_with_cache_salt_keyed_on_the_weight_version_routes_are_fresh(protocol):
    _, after, fresh, version = stale_routes_scenario(protocol, salted=True)
    np.testing.assert_array_equal(after.routed_experts, fresh)
    if protocol != "skyrl":  # SkyRL's endpoint reports no version
        assert after.weight_version == version  # vLLM 0.32+ reports it in its weight_versions spans


@pytest.mark.parametrize("protocol", NAMES_VERSIONS)
def test_a_rollout_across_a_weight_update_is_refused_by_the_trace_naming_both_versions(protocol):
    trace = RoutedExpertTrace()
    conversation = [11, 12, 13, 14]

    async def turn(client):
        nonlocal conversation
        result = await client.generate(
            conversation,
            params(protocol, 2),
            return_routed_experts=True,
            routed_experts_prompt_start=trace.prompt_start,
        )
        trace.record(
            prompt_len=len(conversation),
            generated_len=len(result.response_ids),
            routes=result.routed_experts,
            weight_version=result.weight_version,
        )
        conversation = conversation + list(result.response_ids) + [7]

    async def main(srv):
        async with client_for(srv) as client:
            await turn(client)
            srv.update_weights(weight_version="step-8")
            await turn(client)

    with (
        LoopbackServer(model(), protocol=protocol) as srv,
        pytest.raises(ValueError, match=r"(?s)(step-8.*'0'|'0'.*step-8)"),
    ):
        asyncio.run(main(srv))


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_the_server_rollout_example_builds_a_batch(protocol, capsys):
    path = Path(__file__).parents[1] / "examples" / "server_rollout.py"
    spec = importlib.util.spec_from_file_location("server_rollout", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--server", protocol, "--trajectories", "2", "--turns", "2"]) == 0
    assert f"{protocol}: 2 trajectories -> rollout_expert_indices (2, " in capsys.readouterr().out
