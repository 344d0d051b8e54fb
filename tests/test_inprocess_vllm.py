"""In-process vLLM: what vLLM 0.33.0's own output path builds, read into results and traces.

`fixtures/vllm_inprocess.json` was written by `fixtures/make_vllm_inprocess_fixtures.py`,
which drove vLLM 0.33.0's real `OutputProcessor` (the one under `LLM.generate` and
`AsyncLLM.generate`) with the scheduler's route chunks, and recorded every
`RequestOutput` it returned attribute by attribute, next to the routes fed in.
Here those outputs are rebuilt as plain objects with exactly the recorded
attributes (vLLM itself is not installed in the test environment) and read back.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.vllm_release import release_output
from torch_r3 import RoutedExpertTrace
from torch_r3.health.check import RouteHealthError
from torch_r3.rollout.inprocess import VLLMOutputCollector, collect_vllm_stream, vllm_results

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_inprocess.json").read_text())
CASES = FIXTURE["cases"]


def rebuild(dump: dict) -> SimpleNamespace:
    """A RequestOutput-like object with the recorded attributes (and nothing else)."""
    outputs = []
    for c in dump["outputs"]:
        fields = {name: None for name in c["attributes"]}
        fields.update(
            {k: c[k] for k in ("index", "text", "token_ids", "cumulative_logprob", "finish_reason", "stop_reason")}
        )
        if c["logprobs"] is not None:
            fields["logprobs"] = [{int(t): SimpleNamespace(logprob=v) for t, v in p.items()} for p in c["logprobs"]]
        if c["routed_experts"] is not None:
            fields["routed_experts"] = np.load(io.BytesIO(base64.b64decode(c["routed_experts"])), allow_pickle=False)
        if c["weight_versions"] is not None:
            fields["weight_versions"] = [SimpleNamespace(**s) for s in c["weight_versions"]]
        assert sorted(fields) == c["attributes"]
        outputs.append(SimpleNamespace(**fields))
    fields = {name: None for name in dump["attributes"]}
    fields.update(request_id=dump["request_id"], prompt_token_ids=dump["prompt_token_ids"], finished=dump["finished"])
    fields["outputs"] = outputs
    return SimpleNamespace(**fields)


def stream(case: dict) -> list[SimpleNamespace]:
    return [rebuild(d) for d in case["request_outputs"]]


def kwargs(case: dict) -> dict:
    return {
        "routed_experts_prompt_start": case["start"],
        "num_layers": case["num_layers"],
        "topk": case["topk"],
        "num_experts": case["num_experts"],
        "moe_layers": [1, 2],
    }


def check_results(results, case):
    assert [r.response_ids for r in results] == [tuple(e["token_ids"]) for e in case["expected"]]
    for r, e in zip(results, case["expected"]):
        np.testing.assert_array_equal(r.response_logprobs, np.float32(e["logprobs"]).astype(np.float64))
        assert r.finish_reason == "length"
        want = np.array(e["routes"])
        assert r.routed_experts.dtype == (np.uint8 if want.max() < 256 else np.int16)  # compacted, never wrapped
        np.testing.assert_array_equal(r.routed_experts.astype(np.int64), want)
        assert r.routed_experts.shape[0] == len(case["prompt"]) + len(e["token_ids"]) - 1 - case["start"]
        assert r.health_checked and r.num_experts == case["num_experts"]


def test_the_fixture_comes_from_vllm_033_and_covers_every_mode():
    assert FIXTURE["vllm"] == "0.33.0"
    kinds = {(c["kind"], c["n"], c["dtype"], c["start"]) for c in CASES}
    assert len(kinds) == 36


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "FINAL_ONLY"], ids=lambda c: c["name"])
def test_llm_generate_outputs_decode_to_the_routes_the_engine_captured(case):
    (output,) = stream(case)  # FINAL_ONLY: one RequestOutput holding every sample
    results = vllm_results(output, **kwargs(case))
    check_results(results, case)
    assert all(r.weight_version == "policy-3" and r.raw is output for r in results)


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] != "FINAL_ONLY"], ids=lambda c: c["name"])
def test_streamed_async_llm_outputs_merge_into_the_same_results(case):
    outputs = stream(case)
    collector = VLLMOutputCollector(delta=case["kind"] == "DELTA")
    for output in outputs[:-1]:
        collector.add(output)
    assert not collector.finished
    with pytest.raises(ValueError, match="has not finished"):
        collector.results(**kwargs(case))
    collector.add(outputs[-1])
    assert collector.finished
    check_results(collector.results(**kwargs(case)), case)

    async def agen():
        for output in stream(case):
            yield output

    check_results(asyncio.run(collect_vllm_stream(agen(), delta=case["kind"] == "DELTA", **kwargs(case))), case)


def without_weight_versions(output: SimpleNamespace) -> SimpleNamespace:
    """The same output as vLLM 0.30 and 0.31 build it: their `CompletionOutput` has no `weight_versions` (0.32+)."""
    for c in output.outputs:
        del c.weight_versions
    return output


@pytest.mark.parametrize("kind", ["FINAL_ONLY", "DELTA"])
def test_outputs_of_a_vllm_without_weight_versions_read_as_unversioned(kind):
    # Found by tests/engines (vLLM 0.30.0's own LLM.generate): the reader asked every completion
    # for weight_versions and failed with AttributeError on each.
    case = next(c for c in CASES if c["kind"] == kind and c["n"] == 2 and not c["name"].endswith("-update"))
    outputs = [without_weight_versions(o) for o in stream(case)]
    collector = VLLMOutputCollector(delta=kind == "DELTA")
    for output in outputs:
        collector.add(output)
    results = collector.results(**kwargs(case))
    check_results(results, case)
    assert all(r.weight_version is None and r.weight_versions == () for r in results)
    if kind == "FINAL_ONLY":
        check_results(vllm_results(outputs[-1], **kwargs(case)), case)


def test_a_delta_stream_that_lost_its_routes_names_the_merge_that_dropped_them():
    # Found by tests/engines (AsyncLLM under load): when the consumer falls behind, vLLM merges a
    # DELTA stream's pending outputs (RequestOutput.add(aggregate=True)), and that merge keeps the
    # tokens but not routed_experts; the routes were on, so "start it with --enable-return-routed-experts"
    # would send the user the wrong way.
    case = next(c for c in CASES if c["kind"] == "DELTA" and c["n"] == 1)
    outputs = stream(case)
    outputs[-1].outputs[0].routed_experts = None  # what the merged final output carries
    collector = VLLMOutputCollector(delta=True)
    for output in outputs:
        collector.add(output)
    with pytest.raises(ValueError, match=r"routed_experts is None .*DELTA.*merg.*CUMULATIVE"):
        collector.results(**kwargs(case))


def test_a_delta_streams_last_output_alone_is_refused_by_its_row_count():
    case = next(c for c in CASES if c["kind"] == "DELTA" and c["n"] == 1)
    with pytest.raises(ValueError, match=r"routed_experts has 8 rows; .* need 5; a DELTA stream.*VLLMOutputCollector"):
        vllm_results(stream(case)[-1], **kwargs(case))


@pytest.mark.parametrize("spans", [True, False])
def test_a_delta_streams_last_output_alone_is_refused_when_its_rows_look_like_every_row_from_0(spans):
    # Start 3 with 4 tokens generated and 1 in the last output: its 5 rows (positions 3..7) are as
    # many as 5 prompt + 1 token from position 0 need, the shape of a vLLM that ignored the start.
    case = next(c for c in CASES if c["name"] == "delta-n1-uint8-s3")
    last = stream(case)[-1]
    (completion,) = last.outputs
    assert (len(case["prompt"]), len(completion.token_ids), completion.routed_experts.shape[0]) == (5, 1, 5)
    if not spans:
        completion.weight_versions = None
    with pytest.raises(
        ValueError, match=r"a DELTA stream's last output holds only its last tokens.*VLLMOutputCollector"
    ):
        vllm_results(last, **kwargs(case))
    with pytest.raises(ValueError, match=r"a DELTA stream's last output.*VLLMOutputCollector"):
        vllm_results(last, **{**kwargs(case), "return_routed_experts": spans is False})


@pytest.mark.parametrize(
    ("version", "accepted"), [("0.21.0", True), ("0.14.0rc2", True), ("0.22.0", False), ("0.30.0+cpu", False)]
)
def test_every_row_from_0_is_taken_for_an_ignored_start_only_from_a_vllm_before_022(monkeypatch, version, accepted):
    case = next(c for c in CASES if c["name"] == "final_only-n1-uint8-s3")
    (output,) = stream(case)
    (completion,) = output.outputs
    every_row = np.concatenate([np.zeros((case["start"], 3, 2), np.uint8) + 9, completion.routed_experts])
    completion.routed_experts, completion.weight_versions = every_row, None  # weight_versions came with 0.32
    old = release_output(monkeypatch, version, output)
    if accepted:
        (result,) = vllm_results(old, **kwargs(case))
        np.testing.assert_array_equal(result.routed_experts.astype(np.int64), np.array(case["expected"][0]["routes"]))
    else:
        with pytest.raises(
            ValueError,
            match=r"has 8 rows; positions 3 \.\. 7 .* need 5; a DELTA.*; 8 rows are every position from 0, as a vLLM before 0.22 sends .* vLLM "
            + re.escape(version),
        ):
            vllm_results(old, **kwargs(case))


@pytest.mark.parametrize("kind", ["FINAL_ONLY", "DELTA"])
def test_two_completions_with_the_same_index_are_refused(kind):
    case = next(c for c in CASES if c["kind"] == kind and c["n"] == 1)
    outputs = stream(case)
    first = outputs[0].outputs[0]
    outputs[0].outputs.append(SimpleNamespace(**{**vars(first), "token_ids": [7]}))  # a second sample 0
    with pytest.raises(ValueError, match=r"request 'req-[^']+': outputs\[0\] and outputs\[1\] both have index 0"):
        if kind == "FINAL_ONLY":
            vllm_results(outputs[0], **kwargs(case))
        else:
            VLLMOutputCollector(delta=True).add(outputs[0])


@pytest.mark.parametrize("index", [-1, True, 1.0, "0", None])
def test_a_completion_index_that_is_not_a_non_negative_int_is_refused(index):
    case = next(c for c in CASES if c["kind"] == "FINAL_ONLY" and c["n"] == 1)
    (output,) = stream(case)
    output.outputs[0].index = index
    with pytest.raises(
        TypeError if not isinstance(index, int) or isinstance(index, bool) else ValueError, match="index"
    ):
        vllm_results(output, **kwargs(case))


def test_a_mid_request_weight_update_reaches_the_trace_which_refuses_the_turn():
    case = next(c for c in CASES if c["name"].endswith("-update"))
    collector = VLLMOutputCollector(delta=True)
    for output in stream(case):
        collector.add(output)
    (result,) = collector.results(**kwargs(case))
    assert [(s.version, s.start, s.end) for s in result.weight_versions] == [("policy-2", 0, 2), ("policy-3", 2, 4)]
    assert result.weight_version == "policy-3"
    with pytest.raises(ValueError, match="more than one weight version"):
        RoutedExpertTrace().record_result(result, prompt_len=len(case["prompt"]), prompt_ids=case["prompt"])


def test_in_process_turns_become_one_trace():
    case = next(c for c in CASES if c["kind"] == "FINAL_ONLY" and c["n"] == 1 and c["start"] == 3)
    prompt = case["prompt"]  # turn 1 was prompt[:3] and generated prompt[3]: 3 rows, so turn 2 starts at 3
    first = np.array([[[0, 0], [1, 5], [2, 7]], [[0, 0], [3, 4], [6, 1]], [[0, 0], [8, 2], [9, 3]]])
    trace = RoutedExpertTrace(num_layers=3, topk=2, moe_layers=[1, 2], name="sample 0")
    trace.record(prompt_len=3, generated_len=1, routes=first, prompt_ids=prompt[:3], response_ids=prompt[3:4])
    assert trace.prompt_start == case["start"]
    (result,) = vllm_results(stream(case)[0], **kwargs(case))
    trace.record_result(result, prompt_len=len(prompt), prompt_ids=prompt)
    tokens = prompt + list(result.response_ids)
    routes = trace.finalize(len(tokens))
    np.testing.assert_array_equal(routes[:3], first)
    np.testing.assert_array_equal(routes[3:], np.array(case["expected"][0]["routes"]))
    assert routes.shape[0] == len(tokens) - 1


def test_an_uncaptured_layer_is_refused_naming_the_sample_and_the_vllm_setting():
    case = next(c for c in CASES if c["kind"] == "FINAL_ONLY" and c["n"] == 2)
    (output,) = stream(case)
    output.outputs[1].routed_experts[:, 2] = 0
    with pytest.raises(RouteHealthError, match=r"sample 1: layer 2: .* all zero.*--moe-backend triton"):
        vllm_results(output, **kwargs(case))
    assert len(vllm_results(output, **kwargs(case), health="count")) == 2


def test_missing_routes_name_vllms_switches():
    case = CASES[0]
    (output,) = stream(case)
    output.outputs[0].routed_experts = None
    with pytest.raises(ValueError, match=r"--aux-output-config.*max_bytes.*VLLM_USE_V2_MODEL_RUNNER.*prefix caching"):
        vllm_results(output, **kwargs(case))
    (result,) = vllm_results(output, **{**kwargs(case), "return_routed_experts": False})
    assert result.routed_experts is None and not result.health_checked


def test_wrong_shapes_and_objects_are_refused():
    case = CASES[0]
    (output,) = stream(case)
    with pytest.raises(ValueError, match="expected num_layers=4"):
        vllm_results(output, **{**kwargs(case), "num_layers": 4, "moe_layers": None})
    with pytest.raises(TypeError, match="expected a vllm RequestOutput"):
        vllm_results({"outputs": []})
    other = stream(next(c for c in CASES if c["kind"] == "DELTA"))
    collector = VLLMOutputCollector(delta=True)
    collector.add(other[0])
    with pytest.raises(ValueError, match="must all belong to request"):
        collector.add(output)


def test_import_torch_r3_and_its_engine_adapters_import_no_engine():
    code = (
        "import sys, torch_r3, torch_r3.rollout.inprocess, torch_r3.health, torch_r3.rollout.protocols\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang', 'megatron', 'aiohttp'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
def test_a_stream_stopped_before_its_second_sample_produced_anything_is_refused_naming_it(kind):
    # Issue 43.4: with n=2, a stream cut off after sample 0 finished but before sample 1 produced
    # any output gave one result and no error, although the stream never finished.
    case = next(c for c in CASES if c["kind"] == kind and c["n"] == 2 and not c["name"].endswith("-update"))
    outputs = [o for o in stream(case) if all(c.index == 0 for c in o.outputs)]
    assert outputs[-1].outputs[0].finish_reason is not None  # sample 0 ran to its end
    for o in outputs:
        o.finished = False  # sample 1 has not: vLLM's request is not finished
    collector = VLLMOutputCollector(delta=kind == "DELTA")
    for o in outputs:
        collector.add(o)
    assert not collector.finished
    request = case["request_outputs"][0]["request_id"]
    with pytest.raises(
        ValueError, match=rf"request {request!r} has not finished.*samples seen \[0\], of which \[\] are"
    ):
        collector.results(**kwargs(case))
