"""Every vLLM release with routed experts (0.14.0 to 0.34.0): the adapters read what each one really sends.

`fixtures/vllm_versions.json` was written by `fixtures/make_vllm_versions_fixtures.py`
from the released wheels' own source: per release, the fields of `CompletionOutput`,
the attributes `RequestOutput` sets, whether `SamplingParams` has
`routed_experts_prompt_start`, the route capturer's dtype and layer axis, and the
fields the OpenAI-compatible request, choice and response classes declare. Here each
release's objects and answers are rebuilt with exactly those attributes and fields,
holding routes as that release's engine hands them over, and read back through
`torch_r3.rollout.inprocess` and `RemoteGenerateClient(server="vllm-openai")` on 127.0.0.1.
"""

from __future__ import annotations

import base64
import copy
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests import http_stub
from tests.vllm_release import release_output
from torch_r3 import RoutedExpertTrace
from torch_r3.errors import RemoteGenerateError
from torch_r3.rollout.inprocess import VLLMOutputCollector, vllm_results

HERE = Path(__file__).parent
VERSIONS = json.loads((HERE / "fixtures" / "vllm_versions.json").read_text())["versions"]
# An answer vLLM 0.33.0's own classes built (fixtures/make_openai_fixtures.py): the base every release's is cut from.
OPENAI = json.loads((HERE / "fixtures" / "vllm_openai.json").read_text())
LAYERS, MOE_LAYERS, TOPK, EXPERTS = 4, (1, 2, 3), 2, 16  # layer 0 dense
PROMPT, GENERATED, START = [11, 12, 13, 14, 15, 16], [21, 22, 23], 2


def release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def full_routes(dtype: str, seed: int = 0) -> np.ndarray:
    """Rows of positions `0 .. P + G - 2` over every hidden layer, the dense layer zero, in `dtype`."""
    rng = np.random.default_rng(seed)
    rows = len(PROMPT) + len(GENERATED) - 1
    out = np.zeros((rows, LAYERS, TOPK), np.int64)
    for r in range(rows):
        for layer in MOE_LAYERS:
            out[r, layer] = rng.choice(EXPERTS, TOPK, replace=False)
    return out.astype(dtype)


def engine_dtype(facts: dict) -> str:
    return "uint8" if facts["capture"]["dtype"].startswith("uint8") else facts["capture"]["dtype"]


def request_output(monkeypatch: pytest.MonkeyPatch, version: str, n: int = 1) -> tuple[object, list[np.ndarray]]:
    """A finished `RequestOutput` of release `version`, its attributes only, and the rows each sample must come back with."""
    facts = VERSIONS[version]
    start = START if facts["sampling_params_prompt_start"] else 0  # what the engine itself trims
    split = "prompt_routed_experts" in facts["request_output_attributes"]
    layers = list(MOE_LAYERS) if facts["capture"]["layers"] == "moe" else list(range(LAYERS))
    outputs, expected, prompt_rows = [], [], None
    for i in range(n):
        rows = full_routes(engine_dtype(facts), seed=i)[:, layers]
        if split:  # vLLM 0.21: the prompt's rows on the request (shared), the generated ones' on the completion
            if prompt_rows is None:  # the samples share the prompt, hence its rows
                prompt_rows = rows[: len(PROMPT)]
            rows_here = rows[len(PROMPT) :]
            rows = np.concatenate([prompt_rows, rows_here])
        else:
            rows_here = rows[start:]
        fields = dict.fromkeys(facts["completion_output_fields"])
        fields.update(
            index=i,
            token_ids=list(GENERATED),
            logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in GENERATED],
            finish_reason="length",
            routed_experts=rows_here,
        )
        outputs.append(SimpleNamespace(**fields))
        expected.append(rows[START:])
    attrs = dict.fromkeys(facts["request_output_attributes"])
    attrs.update(request_id="r0", prompt_token_ids=list(PROMPT), outputs=outputs, finished=True)
    if split:
        attrs["prompt_routed_experts"] = prompt_rows
    return release_output(monkeypatch, version, SimpleNamespace(**attrs)), expected


def test_the_fixture_covers_every_release_from_the_first_with_routes_to_034():
    assert list(VERSIONS)[0] == "0.14.0" and list(VERSIONS)[-1] == "0.34.0"
    minors = {release(v)[1] for v in VERSIONS}
    assert minors == set(range(14, 35))
    # The differences the adapters rely on, as the wheels have them.
    assert [v for v, f in VERSIONS.items() if "weight_versions" in f["completion_output_fields"]] == [
        "0.32.0",
        "0.33.0",
        "0.34.0",
    ]
    assert [v for v, f in VERSIONS.items() if "prompt_routed_experts" in f["request_output_attributes"]] == ["0.21.0"]
    assert min(v for v, f in VERSIONS.items() if f["sampling_params_prompt_start"]) == "0.22.0"


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("n", [1, 2])
def test_llm_generate_outputs_of_every_release_decode_to_the_asked_for_rows(monkeypatch, version, n):
    facts = VERSIONS[version]
    output, expected = request_output(monkeypatch, version, n)
    layers = len(MOE_LAYERS) if facts["capture"]["layers"] == "moe" else LAYERS
    results = vllm_results(
        output, routed_experts_prompt_start=START, num_layers=layers, topk=TOPK, num_experts=EXPERTS, health="count"
    )
    assert len(results) == n
    for result, want in zip(results, expected):
        np.testing.assert_array_equal(result.routed_experts.astype(np.int64), want.astype(np.int64))
        assert result.response_ids == tuple(GENERATED) and result.response_logprobs == (-0.5,) * 3
        assert result.weight_version is None  # no release before 0.32 reports one; these samples carry none


@pytest.mark.parametrize("version", ["0.21.0", "0.30.0"])
def test_a_streamed_output_of_these_releases_merges_into_the_same_rows(monkeypatch, version):
    facts = VERSIONS[version]
    output, (want,) = request_output(monkeypatch, version)
    collector = VLLMOutputCollector(delta=False)
    collector.add(output)
    layers = len(MOE_LAYERS) if facts["capture"]["layers"] == "moe" else LAYERS
    (result,) = collector.results(routed_experts_prompt_start=START, num_layers=layers, health="count")
    np.testing.assert_array_equal(result.routed_experts.astype(np.int64), want.astype(np.int64))


def test_vllm_021s_split_rows_join_in_position_order(monkeypatch):
    output, _ = request_output(monkeypatch, "0.21.0")
    trace = RoutedExpertTrace(num_layers=len(MOE_LAYERS), topk=TOPK, num_experts=EXPERTS)
    (result,) = vllm_results(output, routed_experts_prompt_start=trace.prompt_start, health="count")
    trace.record_result(result, prompt_len=len(PROMPT), prompt_ids=PROMPT)
    rows = len(PROMPT) + len(GENERATED) - 1
    want = full_routes("int16")[:, list(MOE_LAYERS)].astype(np.int64)
    np.testing.assert_array_equal(trace.finalize(rows + 1)[:rows].astype(np.int64), want)


def test_vllm_021s_prompt_rows_with_another_layer_axis_are_refused(monkeypatch):
    output, _ = request_output(monkeypatch, "0.21.0")
    output.outputs[0].routed_experts = output.outputs[0].routed_experts[:, :2]
    with pytest.raises(ValueError, match=r"sample 0: routed_experts has shape \(2, 2, 2\).*prompt_routed_experts"):
        vllm_results(output, health="count")


def openai_answer(version: str, start: int) -> tuple[dict, np.ndarray]:
    """A `/v1/completions` answer with the release's choice fields and its route field, and the rows it must give."""
    facts = VERSIONS[version]["openai"]["completions"]
    answer = copy.deepcopy(OPENAI["completions"][0]["response"])
    choice = answer["choices"][0]
    for name in ("token_ids", "prompt_token_ids", "weight_versions"):
        if name not in facts["choice_fields"]:
            choice.pop(name, None)
    prompt, generated = OPENAI["completions"][0]["prompt"], choice["token_ids"]
    rows = full_routes("uint8")[: len(prompt) + len(generated) - 1]
    sent_from = start if "routed_experts_prompt_start" in facts["request_fields"] else 0
    buf = io.BytesIO()
    np.save(buf, rows[sent_from:], allow_pickle=False)
    choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
    if facts["choice_routed_experts"] is None:
        del choice["routed_experts"]
    return answer, rows[start:]


def generate(answer: dict, start: int):
    async def call(client):
        return await client.generate(
            OPENAI["completions"][0]["prompt"],
            {"max_tokens": 4},
            return_routed_experts=True,
            routed_experts_prompt_start=start,
        )

    return http_stub.ask(
        "vllm-openai", "/v1/completions", [answer], call, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS
    )


@pytest.mark.parametrize("version", [v for v in VERSIONS if release(v) >= (0, 22)])
def test_openai_completions_of_every_release_with_npy_routes_give_the_asked_for_rows(version):
    answer, want = openai_answer(version, start=3)
    result, (body,) = generate(answer, start=3)
    np.testing.assert_array_equal(result.routed_experts.astype(np.int64), want.astype(np.int64))
    assert body["routed_experts_prompt_start"] == 3  # sent to all; 0.22 to 0.27 drop it and send every row
    has_spans = "weight_versions" in VERSIONS[version]["openai"]["completions"]["choice_fields"]
    assert (result.weight_version == "policy-7") is has_spans


def test_openai_chat_of_a_release_that_ignores_the_start_is_sliced_by_its_row_count():
    chat = OPENAI["chat"]
    assert "routed_experts_prompt_start" not in VERSIONS["0.27.1"]["openai"]["chat"]["request_fields"]
    turn = chat["turns"][1]  # sent with the start turn 1's rows gave; 0.27 sends every row from 0
    answer = copy.deepcopy(turn["response"])
    answer["choices"][0].pop("weight_versions", None)
    prompt = answer["prompt_token_ids"]
    start = len(prompt) - (len(turn["expected"]["routes"]) - len(answer["choices"][0]["token_ids"]) + 1)
    full = np.asarray(chat["full_routes"], np.uint8)[: len(prompt) + len(answer["choices"][0]["token_ids"]) - 1]
    buf = io.BytesIO()
    np.save(buf, full, allow_pickle=False)
    answer["choices"][0]["routed_experts"] = base64.b64encode(buf.getvalue()).decode()

    async def call(client):
        return await client.chat(
            [{"role": "user", "content": "hi"}],
            {"max_tokens": 4},
            return_routed_experts=True,
            routed_experts_prompt_start=start,
        )

    result, _ = http_stub.ask("vllm-openai", "/v1/chat/completions", [answer], call, num_layers=3, topk=2)
    np.testing.assert_array_equal(result.routed_experts, full[start:])


def test_vllm_021s_nested_list_routes_are_refused_naming_the_release():
    answer, _ = openai_answer("0.22.0", start=0)
    rows = full_routes("int16")[:, list(MOE_LAYERS)]
    answer["choices"][0]["routed_experts"] = rows[5:].tolist()
    answer["prompt_routed_experts"] = rows[:5].tolist()
    with pytest.raises(RemoteGenerateError, match=r"nested list, as vLLM 0\.21 sent it.*0\.22 and later"):
        generate(answer, start=0)


def test_a_release_without_http_routes_is_told_apart_from_a_missing_flag():
    answer, _ = openai_answer("0.20.2", start=0)
    assert "routed_experts" not in answer["choices"][0]
    with pytest.raises(RemoteGenerateError, match=r"before 0\.22, routes come in process only"):
        generate(answer, start=0)
