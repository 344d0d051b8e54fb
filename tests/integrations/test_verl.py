"""`torch_r3.integrations.verl` against verl 0.9.1's own code on the same inputs.

verl's modules come from the installed wheel behind bare parent packages
(`frameworks.load`: `verl/__init__.py` imports Ray); what is compared is verl's
own `left_right_2_no_padding`, `build_r3_replay_mask`,
`align_r3_router_replay_data` and `preprocess_thd_engine`. The agent loop's
padding (`agent_loop.py`, which imports Ray and hydra at module level) is
checked against a reference written from its description, and through verl's
`left_right_2_no_padding`, which consumes it.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.integrations.frameworks import VERL_VERSION, installed_version, load, requires
from tests.samples import router_routes
from torch_r3 import Packed, PromptResponse

pytestmark = [requires("verl"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

pytest.importorskip("megatron.core.transformer.moe.router_replay")

from _models import EXPERTS, TOPK, RouteRecorder, expected_map

LAYERS, P, R = 2, 8, 10


@pytest.fixture(scope="module")
def verl():
    padding, replay = load("verl", "verl.workers.utils.padding", "verl.utils.megatron.router_replay_utils")
    from verl.models.mcore import util

    return padding, replay, util


def test_the_installed_verl_is_the_tested_release():
    assert installed_version("verl") == VERL_VERSION


def samples(seed, n=5, *, fewer=False):
    """Agent-loop outputs: prompt and response lengths, the routes the server captured (n - 1 rows, or fewer)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, P + 1, n).tolist()
    responses = rng.integers(1, R + 1, n).tolist()
    routes = []
    for p, r in zip(prompts, responses):
        rows = p + r - 1 - (int(rng.integers(0, 3)) if fewer else 0)
        routes.append(router_routes(rng, max(rows, 0), LAYERS, TOPK, num_experts=EXPERTS))
    return prompts, responses, routes


def reference_padded(prompts, responses, routes):
    """verl's agent loop, per its description: zeros int16 [1, P + R, L, K], rows from position P - p."""
    out = torch.zeros(len(prompts), P + R, LAYERS, TOPK, dtype=torch.int16)
    for i, (p, rows) in enumerate(zip(prompts, routes)):
        out[i, P - p : P - p + len(rows)] = torch.from_numpy(rows).to(torch.int16)
    return out


def verl_batch(prompts, responses, routed_experts, seed=0):
    """The TensorDict verl's driver holds before `left_right_2_no_padding`."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    b = len(prompts)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    ids = torch.randint(1, 64, (b, P + R), generator=g) * attention
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response_mask,
            "position_ids": positions,
            "routed_experts": routed_experts,
        },
        batch_size=[b],
    )


@pytest.mark.parametrize("fewer", [False, True], ids=["n-1 rows", "multi-turn, fewer rows"])
def test_padded_and_nested_routed_experts_equal_verls(verl, fewer):
    from torch_r3.integrations.verl import compact_sample_routes, nested_routed_experts, padded_routed_experts

    padding, _, _ = verl
    prompts, responses, raw = samples(1 + fewer, fewer=fewer)
    routes = [compact_sample_routes(torch.from_numpy(r).long(), num_experts=EXPERTS) for r in raw]
    assert all(r.dtype == np.uint8 for r in routes)  # what the agent loop keeps: 1 byte per id, no padding
    padded = padded_routed_experts(
        routes,
        prompts,
        responses,
        layout=PromptResponse(prompt_width=P, response_width=R),
    )
    want = reference_padded(prompts, responses, raw)
    assert padded["rollout_expert_indices"].dtype == torch.int16
    assert torch.equal(padded["rollout_expert_indices"], want)

    theirs = padding.left_right_2_no_padding(verl_batch(prompts, responses, want))["routed_experts"]
    assert torch.equal(padded["attention_mask"], verl_batch(prompts, responses, want)["attention_mask"])
    ours, mask = nested_routed_experts(routes, [p + r for p, r in zip(prompts, responses)])
    assert ours.is_nested and ours.dtype == theirs.dtype == torch.int16
    assert torch.equal(ours.offsets(), theirs.offsets()) and ours.offsets().dtype == theirs.offsets().dtype
    assert torch.equal(ours.values(), theirs.values())
    assert mask.values().sum() == sum(p + r for p, r in zip(prompts, responses)) - sum(len(r) for r in routes)


def test_replay_mask_equals_verls_when_each_sample_has_n_minus_1_rows_and_marks_the_captured_rows_otherwise(verl):
    from torch_r3.integrations.verl import nested_routed_experts, replay_mask

    padding, replay, _ = verl
    for fewer in (False, True):
        prompts, responses, routes = samples(4, fewer=fewer)
        batch = padding.left_right_2_no_padding(
            verl_batch(prompts, responses, reference_padded(prompts, responses, routes))
        )
        theirs = replay.build_r3_replay_mask(batch["input_ids"], batch["response_mask"])
        _, mask = nested_routed_experts(routes, [p + r for p, r in zip(prompts, responses)])
        ours = replay_mask(mask)
        captured = torch.cat([torch.arange(p + r) < len(x) for p, r, x in zip(prompts, responses, routes)])
        assert torch.equal(ours.values(), captured)
        assert torch.equal(ours.values(), theirs.values()) is (not fewer)
        if fewer:  # verl replays its zero rows there: expert 0, K times
            assert bool((theirs.values() & ~captured).any())


def test_nested_routes_equal_verls_alignment_of_n_minus_1_rows(verl):
    from torch_r3.integrations.verl import nested_routed_experts

    padding, replay, _ = verl
    prompts, responses, routes = samples(5)
    batch = padding.left_right_2_no_padding(
        verl_batch(prompts, responses, reference_padded(prompts, responses, routes))
    )
    short = torch.nested.as_nested_tensor([torch.from_numpy(r).to(torch.int16) for r in routes], layout=torch.jagged)
    theirs = replay.align_r3_router_replay_data(short, batch["input_ids"])
    ours, _ = nested_routed_experts(routes, [p + r for p, r in zip(prompts, responses)])
    assert torch.equal(ours.values(), theirs.values())


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_microbatch_replays_the_rows_verls_thd_packing_replays(verl, world_of_one, monkeypatch, tp):
    from torch_r3.integrations.verl import microbatch, nested_routed_experts, replay_mask

    padding, replay, util = verl
    prompts, responses, routes = samples(6, fewer=True)
    counts = [p + r for p, r in zip(prompts, responses)]
    batch = padding.left_right_2_no_padding(
        verl_batch(prompts, responses, reference_padded(prompts, responses, routes))
    )
    nested, mask = nested_routed_experts(routes, counts)
    # preprocess_thd_engine aligns each sequence to the TP size: run it as a TP rank of that size would.
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    theirs, params, _ = util.preprocess_thd_engine(batch["routed_experts"], pre_process=True)
    their_mask, _, _ = util.preprocess_thd_engine(replay_mask(mask), pre_process=True)
    ours = microbatch(nested, batch["input_ids"], layout=Packed(pad_to_multiple_of=tp))
    replayed = ~ours["router_padding_mask"]
    assert torch.equal(replayed, their_mask[0])  # the same rows replayed, at the same packed positions
    assert torch.equal(ours["rollout_expert_indices"][replayed].to(torch.int16), theirs[0][replayed])
    assert torch.equal(ours.get("cu_seqlens_padded", ours["cu_seqlens"]), params.cu_seqlens_q_padded)
    # Off those rows verl writes zeros (expert 0 K times) and ours distinct filler experts 0..K-1.
    assert bool((theirs[0][~replayed] == 0).all())


def test_zero_rows_before_a_captured_row_are_refused(verl):
    from torch_r3.integrations.verl import captured_lengths

    rows = torch.tensor([[[1, 2]], [[0, 0]], [[3, 4]]], dtype=torch.int16)
    nested = torch.nested.as_nested_tensor([rows], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"routed_experts\[0\]: row 1 is all zeros"):
        captured_lengths(nested)


def test_one_step_from_verls_batch_replays_exactly(verl, cpu_megatron):
    from _models import build_model

    from torch_r3.integrations.verl import microbatch, nested_routed_experts
    from torch_r3.megatron import ReplayHook

    padding, _, _ = verl
    torch.manual_seed(0)
    model = build_model(seq_len=128)
    prompts, responses, routes = samples(8, n=4, fewer=True)
    counts = [p + r for p, r in zip(prompts, responses)]
    batch = padding.left_right_2_no_padding(
        verl_batch(prompts, responses, reference_padded(prompts, responses, routes))
    )
    nested, _ = nested_routed_experts(routes, counts)
    microbatches = []
    for half in (slice(0, 2), slice(2, 4)):
        ids = torch.nested.as_nested_tensor(list(batch["input_ids"].unbind())[half], layout=torch.jagged)
        part = torch.nested.as_nested_tensor(list(nested.unbind())[half], layout=torch.jagged)
        mb = microbatch(part, ids)
        mb["input_ids"] = mb["input_ids"][None]  # the CPU model runs a packed micro-batch as one [1, N] row
        microbatches.append(mb)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        ids = b["input_ids"]
        output = model(ids, torch.arange(ids.shape[1])[None], None)
        return output, lambda out: (out.float().sum() * 1e-3, {})

    recorder = RouteRecorder(model)
    with ReplayHook(model) as hook:
        hook.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=2,
            seq_length=max(mb["input_ids"].shape[1] for mb in microbatches),
            micro_batch_size=1,
        )
        stats = hook.last_stats
    recorder.close()
    assert stats is not None and stats.microbatches == 2 and stats.live_fraction > 0
    for layer, calls in recorder.calls.items():
        for (_, routing_map), mb in zip(calls, microbatches):
            captured = ~mb["router_padding_mask"]
            want = expected_map(mb["rollout_expert_indices"][None, :, layer])
            assert torch.equal(routing_map[captured], want[captured])


def test_lengths_given_as_tensors_or_numpy_integers_are_read_as_ints(verl):
    """Issue 36 #6: in-range lengths as tensors or NumPy ints were refused, with a message saying out of range."""
    from torch_r3.integrations.verl import microbatch, nested_routed_experts, padded_routed_experts

    prompts, responses, routes = samples(9, n=3, fewer=True)
    want = padded_routed_experts(routes, prompts, responses, prompt_width=P, response_width=R)
    for p, r in (
        (torch.tensor(prompts), torch.tensor(responses)),
        (np.asarray(prompts), np.asarray(responses, dtype=np.int32)),
        ([torch.tensor(v) for v in prompts], [np.int64(v) for v in responses]),
    ):
        got = padded_routed_experts(routes, p, r, prompt_width=P, response_width=R)
        assert torch.equal(got["rollout_expert_indices"], want["rollout_expert_indices"])
    counts = [p + r for p, r in zip(prompts, responses)]
    nested, _ = nested_routed_experts(routes, counts)
    ids = torch.nested.nested_tensor_from_jagged(
        torch.arange(sum(counts)), offsets=torch.tensor([0, *np.cumsum(counts)])
    )
    captured = [len(x) for x in routes]
    reference = microbatch(nested, ids, captured=captured)
    for given in (np.asarray(captured), torch.tensor(captured), [np.int64(c) for c in captured]):
        got = microbatch(nested, ids, captured=given)
        assert torch.equal(got["router_padding_mask"], reference["router_padding_mask"])
        assert torch.equal(got["rollout_expert_indices"], reference["rollout_expert_indices"])


def test_bad_lengths_are_refused_by_what_is_wrong(verl):
    from torch_r3.integrations.verl import microbatch, nested_routed_experts, padded_routed_experts

    prompts, responses, routes = samples(10, n=2)
    with pytest.raises(TypeError, match=r"prompt_lengths\[0\] must be an integer, got a torch.float32 Tensor"):
        padded_routed_experts(
            routes, torch.tensor(prompts, dtype=torch.float32), responses, prompt_width=P, response_width=R
        )
    with pytest.raises(TypeError, match=r"response_lengths\[1\] must be an integer, got bool"):
        padded_routed_experts(routes, prompts, [responses[0], True], prompt_width=P, response_width=R)
    counts = [p + r for p, r in zip(prompts, responses)]
    nested, _ = nested_routed_experts(routes, counts)
    ids = torch.nested.nested_tensor_from_jagged(
        torch.arange(sum(counts)), offsets=torch.tensor([0, *np.cumsum(counts)])
    )
    rows = nested.offsets().diff().tolist()
    with pytest.raises(ValueError, match=rf"captured\[1\] must be <= {rows[1]}, got {rows[1] + 1}"):
        microbatch(nested, ids, captured=np.array([1, rows[1] + 1]))
    with pytest.raises(ValueError, match=r"captured\[0\] must be >= 0, got -1"):
        microbatch(nested, ids, captured=torch.tensor([-1, 0]))


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_thd_alignment_is_verls_packing_alignment(verl, world_of_one, monkeypatch, tp, cp):
    from megatron.core import parallel_state

    from torch_r3.integrations.verl import microbatch, nested_routed_experts, thd_alignment

    padding, _, util = verl
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 0)
    prompts, responses, routes = samples(11)
    batch = padding.left_right_2_no_padding(
        verl_batch(prompts, responses, reference_padded(prompts, responses, routes))
    )
    _, params, _ = util.preprocess_thd_engine(batch["input_ids"], pre_process=True)
    align = thd_alignment(types.SimpleNamespace(fp8=None))
    assert align == (None if tp * cp == 1 else tp * cp * (2 if cp > 1 else 1))
    nested, _ = nested_routed_experts(routes, [p + r for p, r in zip(prompts, responses)])
    ours = microbatch(nested, batch["input_ids"], pad_to_multiple_of=align)
    assert torch.equal(ours.get("cu_seqlens_padded", ours["cu_seqlens"]), params.cu_seqlens_q_padded)


def test_layouts_the_hook_cannot_slice_are_refused_with_the_reason(world_of_one, monkeypatch):
    from megatron.core import parallel_state

    from torch_r3.integrations.verl import EngineReplay, thd_alignment
    from torch_r3.megatron import InterleavedPipelineError

    with pytest.raises(NotImplementedError, match="fp8='e4m3'.*use_fp8_padding"):
        thd_alignment(types.SimpleNamespace(fp8="e4m3"))
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    with pytest.raises(NotImplementedError, match="contiguously"):
        thd_alignment(types.SimpleNamespace(fp8=None, experimental_attention_variant="dsv4_hybrid"))
    with pytest.raises(InterleavedPipelineError, match="2 virtual-pipeline chunks"):
        EngineReplay().hook_for([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)])


@pytest.mark.parametrize("error", [AttributeError, KeyboardInterrupt])
def test_the_swap_verls_install_makes_is_undone_in_every_module_when_one_refuses(verl, monkeypatch, error):
    """`install()`'s mechanism (`torch_r3.integrations.swap.Swaps`) on verl 0.9.1's own padding module
    (`install()` itself needs verl with its dependencies: tests/integrations/test_verl_engine.py): a
    module that bound `left_right_2_no_padding` under another name is swapped, one that refuses the
    assignment is left alone, and `undo()` puts verl's function back everywhere (issue 43.6)."""
    import sys

    from torch_r3.integrations.swap import Swaps

    padding = verl[0]
    original, pad_mask = padding.left_right_2_no_padding, padding.no_padding_2_padding

    class Frozen(types.ModuleType):
        def __setattr__(self, name, value):
            raise error(f"{self.__name__} is read-only")

    user = types.ModuleType("verl_user_alias")
    exec("from verl.workers.utils.padding import left_right_2_no_padding as to_nested", user.__dict__)
    frozen = Frozen("verl_user_frozen_padding")
    frozen.__dict__["back"] = pad_mask
    monkeypatch.setitem(sys.modules, user.__name__, user)
    monkeypatch.setitem(sys.modules, frozen.__name__, frozen)
    swaps = Swaps()
    with pytest.raises(error, match="read-only"):
        swaps.everywhere(padding, "left_right_2_no_padding", lambda data: data)
        swaps.everywhere(padding, "no_padding_2_padding", lambda *a: a)
    assert user.to_nested is padding.left_right_2_no_padding is not original  # half-way
    swaps.undo()
    assert padding.left_right_2_no_padding is original and user.to_nested is original
    assert padding.no_padding_2_padding is pad_mask and frozen.back is pad_mask
