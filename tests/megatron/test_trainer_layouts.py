"""The trainers' layouts through the Megatron hook (one process, gloo, the suite's tiny MoE GPT on the CPU).

The packed layout with per-sequence alignment (`cu_seqlens_padded`), as
Transformer Engine's THD kernels and context parallelism need it
(`R3Collator(layout=Packed(pad_to_multiple_of=m))`): the hook must replay
exactly from it, give the model a padding mask that marks the alignment rows,
record (R2) in it, split it over context-parallel ranks by the aligned bounds,
and refuse zero-filled rows marked to replay. Right padding and the
prompt-left/response-right layout must replay exactly too, their padding
(wherever it is) handed to the model as padding.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron._models import EXPERTS, TOPK, VOCAB, RouteRecorder, expected_map
from tests.samples import route_samples
from torch_r3 import Packed, Padded, PromptResponse, R3Collator
from torch_r3.megatron import ReplayHook
from torch_r3.megatron.slicing import RankSlice, slice_for_rank

MULTIPLE = 4
LENGTHS = (5, 9, 3)  # aligned: 8, 12, 4 -> 24 rows
CAPTURED = (4, 9, 1)


def _samples(seed=0, lengths=LENGTHS, captured=CAPTURED, layers=2):
    return route_samples(
        seed, lengths, captured=captured, num_layers=layers, topk=TOPK, num_experts=EXPERTS, token_ids=(1, VOCAB)
    )


def _aligned_batch(samples, filler="balanced"):
    collator = R3Collator(
        layout=Packed(pad_to_multiple_of=MULTIPLE), filler=filler, num_experts=EXPERTS, pad_token_id=0
    )
    return collator(samples)


def _packed_step():
    """A forward step over one packed row `[1, N]`, positions restarting at each aligned sequence."""

    def step(data_iterator, model):
        batch = next(data_iterator)
        ids = batch["input_ids"][None]
        spans = batch["cu_seqlens_padded"].diff().tolist()
        positions = torch.cat([torch.arange(s) for s in spans])[None]
        output = model(ids, positions, None, labels=torch.roll(ids, -1, dims=1))
        real = torch.zeros(ids.shape[1])
        for start, n in zip(batch["cu_seqlens_padded"].tolist(), batch["cu_seqlens"].diff().tolist()):
            real[start : start + n] = 1

        def loss_func(output_tensor):
            loss = (output_tensor.float() * real).sum()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    return step


def _run(hook, model, batches, *, forward_only=False, record=False):
    return hook.forward_backward(
        record=record,
        forward_step_func=_packed_step(),
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=batches[0]["input_ids"].shape[0],
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _alignment_rows(batch):
    """`[N]` True on each sequence's alignment rows, from the two offset tensors (plain loop)."""
    rows = torch.zeros(batch["rollout_expert_indices"].shape[0], dtype=torch.bool)
    real, spans = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    for i in range(len(real) - 1):
        rows[spans[i] + (real[i + 1] - real[i]) : spans[i + 1]] = True
    return rows


def _capture_padding_mask(model):
    seen = []

    def pre(module, args, kwargs):
        seen.append(kwargs.get("padding_mask"))

    return seen, model.register_forward_pre_hook(pre, with_kwargs=True)


@pytest.mark.parametrize("uncaptured", ["replay", "live"])
@pytest.mark.parametrize("forward_only", [True, False])
def test_routers_replay_exactly_from_the_aligned_packed_layout(make_model, uncaptured, forward_only):
    model = make_model(seq_len=32)
    hook = ReplayHook(model, uncaptured=uncaptured)
    batches = [_aligned_batch(_samples(seed)) for seed in (0, 1)]
    assert batches[0]["rollout_expert_indices"].shape[0] == 24 and batches[0]["cu_seqlens_padded"].tolist() == [
        0,
        8,
        20,
        24,
    ]
    recorder = RouteRecorder(model)
    seen, handle = _capture_padding_mask(model)
    with torch.no_grad():  # left alone, the routers would pick other experts
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn_like(p) * 5)
    _run(hook, model, batches, forward_only=forward_only)
    handle.remove()
    recorder.close()
    for layer, calls in recorder.calls.items():
        assert len(calls) == len(batches)
        for (_, routing_map), batch in zip(calls, batches):
            want = expected_map(batch["rollout_expert_indices"][None, :, layer])
            rows = torch.ones(want.shape[0], dtype=torch.bool)
            if uncaptured == "live":
                rows = ~batch["router_padding_mask"]
            assert rows.any() and torch.equal(routing_map[rows], want[rows]), layer
            if uncaptured == "live":  # the uncaptured rows routed on their own: not the filler
                assert not torch.equal(routing_map[~rows], want[~rows])
    for mask, batch in zip(seen, batches):  # the model's padding_mask: the alignment rows, nothing else
        assert torch.equal(mask, _alignment_rows(batch)[None])
    captured = sum(int((~b["router_padding_mask"]).sum()) for b in batches)
    alignment = sum(int(_alignment_rows(b).sum()) for b in batches)  # no real token: padding, counted apart
    uncaptured_rows = sum(int(b["router_padding_mask"].sum()) for b in batches) - alignment
    tokens = hook.last_stats.tokens
    assert tokens.captured == captured and tokens.padding == alignment > 0
    assert (tokens.live, tokens.filler) == ((uncaptured_rows, 0) if uncaptured == "live" else (0, uncaptured_rows))
    hook.close()


def test_recorded_routes_of_the_aligned_layout_replay_exactly(make_model):
    model = make_model(seq_len=32)
    hook = ReplayHook(model)
    batch = _aligned_batch(_samples(3))
    tokens = {k: batch[k] for k in ("input_ids", "cu_seqlens", "cu_seqlens_padded")}  # no routes
    recorder = RouteRecorder(model)
    _run(hook, model, [tokens], forward_only=True, record=True)
    (rec,) = hook.last_recorded
    assert rec["rollout_expert_indices"].shape == (24, 2, TOPK)
    assert torch.equal(rec["router_padding_mask"], _alignment_rows(batch))
    own = {layer: calls[0][1] for layer, calls in recorder.calls.items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn_like(p) * 5)
    recorder.clear()
    _run(hook, model, [{**tokens, **rec}])
    for layer, calls in recorder.calls.items():
        real = ~rec["router_padding_mask"]
        for _, routing_map in calls:
            assert torch.equal(routing_map[real], own[layer][real])
    recorder.close()
    hook.close()


def test_zero_filled_rows_marked_to_replay_are_refused(make_model):
    model = make_model(seq_len=32)
    batch = _aligned_batch(_samples(4), filler="zeros")
    hook = ReplayHook(model, uncaptured="replay")
    with pytest.raises(
        ValueError, match=r"sequence 0, token 4: expert id 0 twice.*all-zero filler row \(filler='zeros'\)"
    ):
        _run(hook, model, [batch], forward_only=True)
    hook.close()
    live = ReplayHook(model)  # uncaptured rows route live: zero filler is never replayed
    recorder = RouteRecorder(model)
    _run(live, model, [batch], forward_only=True)
    recorder.close()
    for layer, ((_, routing_map),) in recorder.calls.items():
        real = ~batch["router_padding_mask"]
        want = expected_map(batch["rollout_expert_indices"][None, :, layer])
        assert torch.equal(routing_map[real], want[real])
    live.close()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda b: b.update(cu_seqlens_padded=torch.tensor([0, 8, 20])), ValueError, r"expected shape \[4\]"),
        (lambda b: b.update(cu_seqlens_padded=torch.tensor([0, 8, 20, 23])), ValueError, "to the routes' 24 rows"),
        (lambda b: b.update(cu_seqlens_padded=torch.tensor([0, 4, 20, 24])), ValueError, "sequence 0 has 5 real"),
        (lambda b: b.update(cu_seqlens_padded=torch.tensor([0.0, 8, 20, 24])), TypeError, "integer torch.Tensor"),
        (lambda b: b.pop("cu_seqlens"), ValueError, r"expected \[B, T, L, K=2\]"),
    ],
)
def test_bad_aligned_offsets_are_refused_before_installing(make_model, change, error, match):
    model = make_model(seq_len=32)
    hook = ReplayHook(model)
    batch = dict(_aligned_batch(_samples(5)))
    change(batch)
    with pytest.raises(error, match=match):
        _run(hook, model, [batch], forward_only=True)
    assert all(r.replay.replay_backward_list == [] for r in hook._routers)
    hook.close()


def _te_thd_positions(spans, cp_size, cp_rank):
    """Transformer Engine's THD context-parallel split, written out: each aligned sequence in 2 * cp chunks."""
    out = []
    for start, end in zip(spans[:-1], spans[1:]):
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out += list(range(start + c * chunk, start + (c + 1) * chunk))
    return out


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_slicing_follows_the_aligned_bounds(cp_size):
    # Unaligned lengths (5, 9, 3): refused by the CP split; aligned to 2 * cp they split exactly.
    samples = _samples(6)
    unaligned = R3Collator(layout="packed", pad_token_id=0)(samples)
    with pytest.raises(
        ValueError, match=rf"layout=torch_r3.Packed\(pad_to_multiple_of={2 * cp_size}\) and pass its cu_seqlens_padded"
    ):
        slice_for_rank(
            unaligned["rollout_expert_indices"],
            unaligned["router_padding_mask"],
            RankSlice(cp_size=cp_size),
            cu_seqlens=unaligned["cu_seqlens"],
        )
    batch = R3Collator(
        layout=Packed(pad_to_multiple_of=2 * cp_size),
        pad_token_id=0,
    )(samples)
    spans = batch["cu_seqlens_padded"].tolist()
    for rank in range(cp_size):
        local, mask = slice_for_rank(
            batch["rollout_expert_indices"],
            batch["router_padding_mask"],
            RankSlice(cp_size=cp_size, cp_rank=rank),
            cu_seqlens=batch["cu_seqlens_padded"],
        )
        want = _te_thd_positions(spans, cp_size, rank)
        assert torch.equal(local[0], batch["rollout_expert_indices"][want])
        assert torch.equal(mask[0], batch["router_padding_mask"][want])


@pytest.mark.parametrize(
    "layout",
    [Padded(side="right"), PromptResponse(prompt_width=6, response_width=7)],
    ids=["right", "prompt_response"],
)
def test_routers_replay_exactly_from_right_and_prompt_response_padding(make_model, layout):
    from tests.megatron._models import forward_step

    model = make_model(seq_len=16)
    samples = _samples(7, lengths=(9, 12, 4), captured=(8, 11, 4))
    for s, p in zip(samples, (3, 6, 0)):
        s["prompt_length"] = p
    batch = R3Collator(layout=layout, filler="balanced", num_experts=EXPERTS, pad_token_id=0)(samples)
    want_starts = [0, 0, 0] if isinstance(layout, Padded) else [3, 0, 6]
    for i, (s, start) in enumerate(zip(samples, want_starts)):  # where the real tokens are, written out
        n = len(s["input_ids"])
        assert batch["attention_mask"][i].tolist() == [
            int(start <= t < start + n) for t in range(batch["input_ids"].shape[1])
        ]
    hook = ReplayHook(model)
    recorder = RouteRecorder(model)
    seen, handle = _capture_padding_mask(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn_like(p) * 5)
    hook.forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter([batch]),
        model=[model],
        num_microbatches=1,
        seq_length=batch["input_ids"].shape[1],
        micro_batch_size=batch["input_ids"].shape[0],
    )
    handle.remove()
    recorder.close()
    real = (~batch["router_padding_mask"]).transpose(0, 1).reshape(-1)
    for layer, calls in recorder.calls.items():
        want = expected_map(batch["rollout_expert_indices"][:, :, layer])
        for _, routing_map in calls:
            assert torch.equal(routing_map[real], want[real]), layer
    assert torch.equal(seen[0], batch["attention_mask"] == 0)  # padding on the right is padding too
    hook.close()
