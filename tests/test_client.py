"""RemoteGenerateClient's transport and arguments, against the torch_r3 loopback server.

Behaviour common to every protocol (multi-turn traces, load, restarts, faults,
weight updates) is tested per protocol in `test_client_e2e.py`; hostile servers
in `test_client_transport.py`. Nothing is mocked: the server is real aiohttp on
127.0.0.1.

References are computed in-process by the same seeded model the server serves,
never by the client under test.
"""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys

import numpy as np
import pytest

from tests.http_stub import client_kwargs_of
from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError, RemoteGenerateResult, TransportConfig
from torch_r3.routes import compact_routes
from torch_r3.testing import LoopbackServer, TinyMoELM

FAST = {"retries": 4, "backoff": 0.01, "max_backoff": 0.05, "timeout": 20.0}
REFERENCE = TinyMoELM()  # same seed and shape as the server's default model


def _warm(server: LoopbackServer) -> LoopbackServer:
    server.model.generate([1], {"max_new_tokens": 1})  # first torch call is slow; keep it out of timeouts
    return server


@pytest.fixture(scope="module")
def server():
    with LoopbackServer() as srv:
        yield _warm(srv)


@pytest.fixture(autouse=True)
def _no_leftover_faults(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").faults.clear()


def generate(url, *args, client_kwargs=None, **kwargs) -> RemoteGenerateResult:
    async def main():
        async with RemoteGenerateClient(url, **client_kwargs_of(client_kwargs or {}, **FAST)) as client:
            return await client.generate(*args, **kwargs)

    return asyncio.run(main())


def reference(prompt, params):
    out = REFERENCE.generate(prompt, params)
    return out.token_ids, out.logprobs, compact_routes(out.routes)


# -- the happy path -----------------------------------------------------------


def test_generate_returns_the_models_tokens_logprobs_and_routes(server):
    prompt, params = [3, 14, 15, 9, 2], {"max_new_tokens": 6}
    result = generate(server.url, prompt, params, return_routed_experts=True)
    ids, logprobs, routes = reference(prompt, params)
    assert list(result.response_ids) == ids
    np.testing.assert_allclose(result.response_logprobs, logprobs)
    assert result.finish_reason == "length"
    assert result.routed_experts.shape == (len(prompt) + len(ids) - 1, 2, 2)
    np.testing.assert_array_equal(result.routed_experts, routes)
    assert result.raw["choices"][0]["token_ids"] == ids


@pytest.mark.parametrize("start", [0, 3, 7])
def test_prompt_start_returns_only_the_rows_from_there_on(server, start):
    prompt, params = [5, 4, 3, 2, 1, 0, 9], {"max_new_tokens": 3}
    result = generate(server.url, prompt, params, return_routed_experts=True, routed_experts_prompt_start=start)
    np.testing.assert_array_equal(result.routed_experts, reference(prompt, params)[2][start:])


def test_seeded_sampling_matches_the_reference(server):
    prompt, params = [7, 7, 7], {"max_new_tokens": 5, "temperature": 1.0, "seed": 42}
    result = generate(server.url, prompt, params, return_routed_experts=True)
    assert list(result.response_ids) == reference(prompt, params)[0]


def test_concurrency_is_bounded_by_the_semaphore(server):
    server.faults.stall(0.2, n=6)
    before = server.stats.max_in_flight
    server.stats.max_in_flight = 0

    async def main():
        async with RemoteGenerateClient(
            server.url, transport_config=TransportConfig(**FAST, max_concurrency=2)
        ) as client:
            await asyncio.gather(*(client.generate([i + 1], {"max_new_tokens": 1}) for i in range(6)))

    asyncio.run(main())
    assert server.stats.max_in_flight == 2
    server.stats.max_in_flight = max(before, 2)


# -- argument checks (no request is sent) ----------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"routed_experts_prompt_start": True, "return_routed_experts": True}, TypeError, "must be an int"),
        ({"routed_experts_prompt_start": 1.0, "return_routed_experts": True}, TypeError, "must be an int"),
        ({"routed_experts_prompt_start": -1, "return_routed_experts": True}, ValueError, "in [0, len(prompt)=3]"),
        ({"routed_experts_prompt_start": 4, "return_routed_experts": True}, ValueError, "in [0, len(prompt)=3]"),
        ({"routed_experts_prompt_start": 1}, ValueError, "requires return_routed_experts=True"),
        ({"sampling_params": {"routed_experts_prompt_start": 1}}, ValueError, "keyword argument"),
        ({"sampling_params": [("max_new_tokens", 1)]}, TypeError, "sampling_params"),
        ({"prompt": [1, True, 3]}, TypeError, "prompt_token_ids[1]"),
        ({"prompt": "abc"}, TypeError, "prompt_token_ids"),
        ({"return_routed_experts": 1}, TypeError, "return_routed_experts must be a bool"),
        ({"session_id": 7}, TypeError, "session_id"),
    ],
)
def test_bad_arguments_are_refused_before_sending(kwargs, error, words):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", [1, 2, 3])
    params = kwargs.pop("sampling_params", {})
    client = RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(retries=0))

    async def main():
        async with client:
            await client.generate(prompt, params, **kwargs)

    with pytest.raises(error) as info:
        asyncio.run(main())
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"retries": -1}, ValueError),
        ({"retries": 1.5}, TypeError),
        ({"timeout": 0}, ValueError),
        ({"max_concurrency": 0}, ValueError),
        ({"backoff": "1"}, TypeError),
    ],
)
def test_transport_config_is_validated_up_front(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(**kwargs))
    with pytest.warns(DeprecationWarning), pytest.raises(error, match=next(iter(kwargs))):
        RemoteGenerateClient("http://127.0.0.1:9", **kwargs)  # the old flat keyword: checked the same


def test_base_url_must_be_http():
    with pytest.raises(ValueError, match="http://"):
        RemoteGenerateClient("127.0.0.1:9")


# -- faults ------------------------------------------------------------------------


def test_4xx_with_json_error_is_not_retried_and_names_the_server_message(server):
    before = server.stats.requests
    server.faults.status(422, message="token 99 is out of vocabulary")
    with pytest.raises(RemoteGenerateError) as info:
        generate(server.url, [1], {})
    assert info.value.status == 422 and info.value.attempts == 1
    assert "HTTP 422: token 99 is out of vocabulary" in str(info.value) and server.url in str(info.value)
    assert server.stats.requests == before + 1


def test_4xx_without_json_error_shows_the_body(server):
    server.faults.status(404, message="no such route", json_error=False)
    with pytest.raises(RemoteGenerateError, match="HTTP 404: no such route"):
        generate(server.url, [1], {})


def test_the_servers_own_400_is_surfaced(server):
    with pytest.raises(RemoteGenerateError, match=r"HTTP 400: token_ids\[1\] must be an int in \[0, 64\)"):
        generate(server.url, [1, 640], {})


def test_500_is_not_retried(server):
    before = server.stats.requests
    server.faults.status(500)
    with pytest.raises(RemoteGenerateError, match="HTTP 500"):
        generate(server.url, [1], {})
    assert server.stats.requests == before + 1


def test_gateway_errors_past_the_budget_name_the_last_status(server):
    server.faults.status(503, n=3, message="overloaded")
    with pytest.raises(RemoteGenerateError) as info:
        generate(server.url, [1], {}, client_kwargs={"retries": 2})
    assert info.value.attempts == 3 and info.value.status == 503
    assert "last cause: HTTP 503: overloaded" in str(info.value)


def test_a_stall_past_the_timeout_is_retried(server):
    before = server.stats.requests
    server.faults.stall(30.0)
    result = generate(server.url, [6, 1], {"max_new_tokens": 2}, client_kwargs={"timeout": 1.0})
    assert list(result.response_ids) == reference([6, 1], {"max_new_tokens": 2})[0]
    assert server.stats.requests == before + 2


@pytest.mark.timeout(30)
def test_dead_server_fails_after_the_retry_budget_naming_url_and_cause():
    with LoopbackServer(TinyMoELM(num_layers=1)) as srv:
        url = srv.url  # a port that was just free and is now closed again
    with pytest.raises(RemoteGenerateError) as info:
        generate(url, [1], {}, client_kwargs={"retries": 3})
    message = str(info.value)
    assert url + "/v1/generate" in message and "after 4 attempt(s)" in message
    assert "last cause: ClientConnectorError" in message and info.value.status is None


# -- sessions, loops and pickling -----------------------------------------------------


def test_one_session_per_loop_and_never_a_foreign_or_closed_one(server):
    client = RemoteGenerateClient(server.url, transport_config=TransportConfig(**FAST))

    async def use():
        await client.generate([1], {"max_new_tokens": 1})
        session = (await client._transport.state()).session
        await client.generate([2], {"max_new_tokens": 1})
        assert (await client._transport.state()).session is session  # reused within its loop
        return session

    first = asyncio.run(use())  # the loop ends without client.close()
    assert first.closed  # closed on its own loop as that loop shut down
    second = asyncio.run(use())
    assert second is not first  # never a foreign loop's session

    async def after_close():
        await client.close()
        assert second.closed
        await client.generate([3], {"max_new_tokens": 1})  # a closed session is replaced
        third = (await client._transport.state()).session
        await client.close()
        return third

    third = asyncio.run(after_close())
    assert third is not second and third.closed


def test_async_with_closes_the_session(server):
    async def main():
        async with RemoteGenerateClient(server.url, transport_config=TransportConfig(**FAST)) as client:
            await client.generate([1], {"max_new_tokens": 1})
            session = (await client._transport.state()).session
        return session

    assert asyncio.run(main()).closed


def test_pickled_client_works_in_a_new_loop_and_a_new_process(server):
    client = RemoteGenerateClient(server.url, transport_config=TransportConfig(**FAST, max_concurrency=3))

    async def warm():
        await client.generate([1], {"max_new_tokens": 1})
        return pickle.dumps(client)  # with a live session and semaphore

    blob = asyncio.run(warm())
    clone = pickle.loads(blob)
    assert clone.transport_config == client.transport_config and clone.base_url == client.base_url
    assert list(generate_with(clone, [2, 3])) == reference([2, 3], {"max_new_tokens": 2})[0]

    code = (
        "import asyncio, pickle, sys\n"
        "client = pickle.loads(sys.stdin.buffer.read())\n"
        "async def main():\n"
        "    async with client:\n"
        "        r = await client.generate([2, 3], {'max_new_tokens': 2}, return_routed_experts=True)\n"
        "    print(list(r.response_ids), r.routed_experts.shape)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True, timeout=120)
    ids = reference([2, 3], {"max_new_tokens": 2})[0]
    assert out.stdout.decode().strip() == f"{ids} (3, 2, 2)"


def generate_with(client, prompt):
    async def main():
        async with client:
            return (await client.generate(prompt, {"max_new_tokens": 2})).response_ids

    return asyncio.run(main())


def test_model_info_reports_the_served_models_routing_shape():
    model = TinyMoELM(num_layers=3, num_experts=6, topk=2, seed=1)
    with LoopbackServer(model) as srv:

        async def main():
            async with RemoteGenerateClient(srv.url, transport_config=TransportConfig(retries=0)) as client:
                return await client.model_info()

        info = asyncio.run(main())
    assert (info["num_layers"], info["num_experts"], info["topk"]) == (3, 6, 2)


def test_model_info_of_a_dead_server_names_the_url_after_retries():
    with LoopbackServer() as srv:
        url = srv.url
    # The server is gone: the port refuses connections.

    async def main():
        async with RemoteGenerateClient(
            url, transport_config=TransportConfig(retries=1, backoff=0.01, connect_timeout=2)
        ) as client:
            return await client.model_info()

    with pytest.raises(RemoteGenerateError, match=r"GET .*/v1/model_info failed after 2 attempt"):
        asyncio.run(main())


@pytest.mark.parametrize("server_name", ["sglang", "vllm"])
def test_model_info_is_only_for_the_torch_r3_server(server_name):
    async def main():
        async with RemoteGenerateClient(
            "http://127.0.0.1:9", server=server_name, transport_config=TransportConfig(retries=0)
        ) as client:
            return await client.model_info()

    with pytest.raises(ValueError, match="read the model's config"):
        asyncio.run(main())


def test_an_unknown_server_is_refused():
    with pytest.raises(
        ValueError,
        match=r"server must be one of \['torch_r3', 'sglang', 'vllm', 'vllm-openai', 'sglang-openai', 'megatron', 'skyrl'\]",
    ):
        RemoteGenerateClient("http://127.0.0.1:9", server="tgi")


@pytest.mark.parametrize(
    "module", ["torch_r3.rollout.client", "torch_r3.rollout.transport", "torch_r3.rollout.protocols.fields"]
)
def test_docstring_examples_of_the_client_modules_hold(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_the_readers_keep_their_path_on_protocols_base_as_the_same_objects():
    from torch_r3.rollout.protocols import base, fields

    own = [
        n for n, v in vars(fields).items() if not n.startswith("_") and getattr(v, "__module__", "") == fields.__name__
    ]
    moved = [n for n in own if n not in vars(base)]
    assert len(own) > 10
    assert moved == [], f"protocols.base lost the path of {moved}"
    for name in ("WeightVersionSpan", "check_cache_salt", "get_field", "token_ids", "slice_to_start", "MAX_SALT_CHARS"):
        assert getattr(base, name) is getattr(fields, name)
    # the contract stays in base, the readers in fields: neither module holds the other's job
    assert base.ServerProtocol.__module__ == base.__name__ and fields.get_field.__module__ == fields.__name__


OLD_TRANSPORT_KEYWORDS = {
    "retries": 2,
    "backoff": 0.1,
    "max_backoff": 1.0,
    "timeout": 5.0,
    "connect_timeout": 3.0,
    "max_concurrency": 3,
    "max_response_bytes": 1 << 20,
    "headers": {"X-Api-Key": "k"},
    "ssl": False,
    "trace_configs": None,
}


def test_a_transport_config_object_configures_the_client():
    config = TransportConfig(retries=2, backoff=0.1, max_backoff=1.0, timeout=5.0, max_response_bytes=1 << 20)
    client = RemoteGenerateClient("http://127.0.0.1:9", transport_config=config)
    assert client.transport_config is config
    assert client.limits.max_bytes == (1 << 20) // 4 * 3 and client.limits.max_indexer_bytes == 1 << 20
    with pytest.raises(TypeError, match="TransportConfig"):
        RemoteGenerateClient("http://127.0.0.1:9", transport_config={"retries": 2})


@pytest.mark.parametrize("name", sorted(OLD_TRANSPORT_KEYWORDS))
def test_an_old_flat_transport_keyword_warns_on_the_callers_line_and_still_works(name):
    value = OLD_TRANSPORT_KEYWORDS[name]
    with pytest.warns(DeprecationWarning) as seen:
        client = RemoteGenerateClient("http://127.0.0.1:9", **{name: value})
    assert [str(w.message) for w in seen] == [
        f"RemoteGenerateClient({name}=) is deprecated; use transport_config=TransportConfig({name}=...) instead "
        "(same meaning)"
    ]
    assert [w.filename for w in seen] == [__file__]
    # the very config the new keyword builds
    assert client.transport_config == TransportConfig(**{name: value})
    assert (
        client.limits
        == RemoteGenerateClient("http://127.0.0.1:9", transport_config=TransportConfig(**{name: value})).limits
    )


def test_the_old_session_keyword_warns_and_uses_the_session():
    import aiohttp

    async def main():
        async with aiohttp.ClientSession() as session:
            with pytest.warns(DeprecationWarning, match=r"RemoteGenerateClient\(session=\)"):
                client = RemoteGenerateClient("http://127.0.0.1:9", session=session)
            assert client.transport_config.session is session
            assert (await client._transport.state()).session is session

    asyncio.run(main())


def test_old_keywords_beside_transport_config_are_refused_unless_at_their_defaults():
    config = TransportConfig(retries=2)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match=r"either transport_config= or the keywords \['retries'\]"),
    ):
        RemoteGenerateClient("http://127.0.0.1:9", transport_config=config, retries=1)
    with pytest.warns(DeprecationWarning):  # at its old default: warned, and the config is used
        assert RemoteGenerateClient("http://127.0.0.1:9", transport_config=config, retries=5).transport_config is config


def test_the_table_of_renamed_keywords_holds_every_transport_option_at_its_default():
    import dataclasses

    from torch_r3._deprecation import RENAMED_KEYWORDS

    table = {k: v for k, v in RENAMED_KEYWORDS.items() if v.new == "transport_config"}
    defaults = TransportConfig()
    assert sorted(table) == sorted(f.name for f in dataclasses.fields(TransportConfig))
    for name, entry in table.items():
        assert entry.field == name and entry.old_default == getattr(defaults, name)


def test_a_keyword_the_client_never_had_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'retry'"):
        RemoteGenerateClient("http://127.0.0.1:9", retry=2)


def test_the_client_and_the_collator_take_at_most_twelve_parameters():
    import inspect

    from torch_r3 import R3Collator

    # The options a caller passes, as the issue counted them (0.2.0's client: 22). `**deprecated`
    # takes no option of its own: only the old spellings of `_deprecation.RENAMED_KEYWORDS`, each
    # warned and folded into these (a name it does not hold is a TypeError, tested above).
    for cls in (RemoteGenerateClient, R3Collator):
        parameters = inspect.signature(cls).parameters
        options = [n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        assert len(options) <= 12, f"{cls.__name__} takes {len(options)}: {options}"
        assert all(p.kind is not inspect.Parameter.VAR_POSITIONAL for p in parameters.values())
    assert "transport_config" in inspect.signature(RemoteGenerateClient).parameters


def test_the_old_transport_property_is_a_deprecated_alias():
    client = RemoteGenerateClient("http://127.0.0.1:9")
    with pytest.warns(DeprecationWarning, match="transport_config"):
        assert client.transport == client.transport_config


# -- the ids are range-checked once on the client path ---------------------------------------


def _rollout_results(url, turns=3, **client_kwargs):
    async def main():
        from torch_r3.rollout.trace import RoutedExpertTrace

        trace, conversation, results = RoutedExpertTrace(), [11, 12, 13], []
        async with RemoteGenerateClient(url, **client_kwargs_of(client_kwargs, **FAST)) as client:
            for _ in range(turns):
                result = await client.generate(
                    conversation,
                    {"max_new_tokens": 2},
                    return_routed_experts=True,
                    routed_experts_prompt_start=trace.prompt_start,
                )
                trace.record_result(result, prompt_len=len(conversation))
                results.append((len(conversation), result))
                conversation = conversation + list(result.response_ids) + [7]
        return results

    return asyncio.run(main())


def test_record_result_records_what_record_does(server):
    from torch_r3.rollout.trace import RoutedExpertTrace

    results = _rollout_results(server.url, num_experts=8)
    by_result, by_fields = RoutedExpertTrace(num_experts=8), RoutedExpertTrace(num_experts=8)
    for prompt_len, r in results:
        by_result.record_result(r, prompt_len=prompt_len)
        by_fields.record(
            prompt_len=prompt_len,
            generated_len=len(r.response_ids),
            routes=r.routed_experts,
            weight_version=r.weight_version,
            weight_versions=r.weight_versions,
        )
    assert by_result.weight_versions == by_fields.weight_versions and results[0][1].num_experts == 8
    np.testing.assert_array_equal(by_result.finalize(token_count=12), by_fields.finalize(token_count=12))


def test_record_result_trusts_the_clients_check_and_scans_only_for_a_tighter_bound(server):
    import dataclasses

    from torch_r3.rollout.trace import RoutedExpertTrace

    (prompt_len, checked), *_ = _rollout_results(server.url, turns=1, num_experts=8)
    claimed = dataclasses.replace(checked, routed_experts=np.full_like(checked.routed_experts, 7))
    # The client's decoder checked ids < 8: a trace with the same bound does not scan again.
    RoutedExpertTrace(num_experts=8).record_result(claimed, prompt_len=prompt_len)
    # A tighter bound than the client's is checked by the trace itself.
    with pytest.raises(ValueError, match=r"turn 0: routes: expert ids must be in \[0, num_experts\), found 7"):
        RoutedExpertTrace(num_experts=7).record_result(claimed, prompt_len=prompt_len)
    unchecked = dataclasses.replace(claimed, num_experts=None)
    with pytest.raises(ValueError, match="found 7"):
        RoutedExpertTrace(num_experts=6).record_result(unchecked, prompt_len=prompt_len)
    with pytest.raises(TypeError, match="expected a RemoteGenerateResult"):
        RoutedExpertTrace().record_result(checked.routed_experts, prompt_len=prompt_len)
