"""Mistakes a new user makes with the trace and the Ray fetch: each refusal says what to do.

No Ray cluster: every refusal here happens before anything reaches the object store.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.samples import router_routes
from torch_r3 import RoutedExpertTrace

L, K = 3, 2


def test_a_turn_sent_without_the_prompt_start_is_told_to_send_it():
    trace = RoutedExpertTrace()
    trace.record(prompt_len=4, generated_len=3, routes=router_routes(6, 6, L, K))
    assert trace.prompt_start == 6
    # Turn 2 asked the server without routed_experts_prompt_start: rows for every position from 0.
    with pytest.raises(ValueError) as e:
        trace.record(prompt_len=9, generated_len=2, routes=router_routes(10, 10, L, K))
    message = str(e.value)
    assert message.startswith("turn 1: expected prompt_len - prompt_start + generated_len - 1 = 9 - 6 + 2 - 1 = 4")
    assert "rows from the trace's start (6): client.generate(" in message
    assert "routed_experts_prompt_start=trace.prompt_start)" in message
    # A row count that is simply wrong gets no such hint.
    with pytest.raises(ValueError) as e:
        trace.record(prompt_len=9, generated_len=2, routes=router_routes(5, 5, L, K))
    assert "routed_experts_prompt_start" not in str(e.value)


ray_module = pytest.importorskip("torch_r3.ray", reason="the ray extra is not installed")


def _ref(n: int = 4):
    return ray_module.TrajectoryRef(ref=None, num_tokens=n, num_rows=n - 1, num_layers=L, topk=K, dtype="uint8")


def test_ref_fetch_refuses_float_keys_instead_of_truncating_them():
    a, b = _ref(4), _ref(5)
    with pytest.raises(TypeError, match=r"^refs key 0\.7 must be an int, got float$"):
        ray_module.RefFetch({0.7: a, 0.2: b})
    with pytest.raises(ValueError, match=r"^refs key -1 must be >= 0, got -1$"):
        ray_module.RefFetch({-1: a})
    fetch = ray_module.RefFetch({np.int64(3): a, 7: b})  # NumPy ints are ints
    assert sorted(fetch.refs) == [3, 7] and all(type(k) is int for k in fetch.refs)


def test_ref_fetch_of_a_ranks_own_list_says_a_list_is_indexed_by_global_id():
    mine = [_ref(4), _ref(5)]  # this rank's refs for global samples 4 and 5, passed as a list
    with pytest.raises(KeyError) as e:
        ray_module.RefFetch(mine)([4, 5])
    message = e.value.args[0]
    assert message.startswith("sample 4: this rank holds no ref for it (it holds global samples [0, 1])")
    assert "pass this rank's refs as {global_index: ref}" in message
    with pytest.raises(KeyError) as e:  # a dict already says which sample is which: no hint
        ray_module.RefFetch({4: mine[0]})([5])
    assert "{global_index: ref}" not in e.value.args[0]


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("advantages", torch.ones(4, dtype=torch.bfloat16), "sample['advantages']: a torch.bfloat16 tensor"),
        ("input_ids", torch.ones(4, dtype=torch.bfloat16), "sample['input_ids']: a torch.bfloat16 tensor"),
        ("routes", torch.zeros((3, L, K), dtype=torch.bfloat16), "sample['routes']: a torch.bfloat16 tensor"),
    ],
)
def test_put_trajectory_names_the_key_of_a_bfloat16_tensor(key, value, words):
    sample = {"input_ids": list(range(4)), "routes": np.zeros((3, L, K), np.uint8), "advantages": np.ones(4)}
    sample[key] = value
    with pytest.raises(TypeError) as e:
        ray_module.put_trajectory(sample)
    assert str(e.value).startswith(words) and ".float()" in str(e.value)


def test_the_advice_for_a_forgotten_prompt_start_is_a_call_that_works():
    # Follow the refusal's advice to the letter: its client.generate(...) call, run as written, is accepted.
    import asyncio
    import re

    from torch_r3.rollout.client import RemoteGenerateClient, TransportConfig
    from torch_r3.testing import LoopbackServer

    async def main(url):
        trace = RoutedExpertTrace()
        sampling_params = {"max_new_tokens": 3}
        async with RemoteGenerateClient(url, transport_config=TransportConfig(retries=0)) as client:
            first = await client.generate([1, 2, 3, 4], sampling_params, return_routed_experts=True)
            trace.record_result(first, prompt_len=4)
            prompt_ids = [1, 2, 3, 4, *first.response_ids, 9, 10]
            # Turn 2 without the start: rows from position 0, refused with the advice.
            forgot = await client.generate(prompt_ids, sampling_params, return_routed_experts=True)
            with pytest.raises(ValueError) as e:
                trace.record_result(forgot, prompt_len=len(prompt_ids))
            advice = re.search(r"client\.generate\(.*?\)(?= \()", str(e.value))
            assert advice is not None, str(e.value)
            result = await eval(advice.group(0), {"client": client, "trace": trace}, locals())
            trace.record_result(result, prompt_len=len(prompt_ids))
            return trace, result, forgot

    with LoopbackServer() as server:
        trace, result, forgot = asyncio.run(main(server.url))
    assert trace.turns == 2
    start = 4 + 3 - 1
    # The rows recorded for turn 2 are the full answer's rows from the trace's start on.
    np.testing.assert_array_equal(result.routed_experts, forgot.routed_experts[start:])
