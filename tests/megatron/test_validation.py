"""Routes are checked before Megatron uses them; a short data iterator is an error."""

from __future__ import annotations

import pytest
import torch

from tests.megatron._models import EXPERTS, forward_step, make_batch, run_step
from torch_r3.megatron import ReplayHook


def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: calls.append(1), with_kwargs=True)
    return calls, handle


def _two_microbatches(dtype=torch.int16):
    g = torch.Generator().manual_seed(5)
    return [make_batch(generator=g, dtype=dtype) for _ in range(2)]


def _set_expert(batch, row, token, layer, slot, value):
    batch["rollout_expert_indices"][row, token, layer, slot] = value


@pytest.mark.parametrize(
    "value, dtype, what",
    [
        (EXPERTS, torch.uint8, r"expert id 8 outside \[0, 8\)"),
        (-1, torch.int16, r"expert id -1 outside \[0, 8\)"),
        ("duplicate", torch.int32, r"expert id \d+ twice in one route"),
    ],
)
def test_bad_expert_ids_are_refused_naming_microbatch_layer_and_position_before_the_model_runs(
    make_model, value, dtype, what
):
    model = make_model()
    hook = ReplayHook(model)
    batches = _two_microbatches(dtype)
    # Row 1's captured tokens are 5..13 (11 real, 9 captured); token 7 is captured.
    routes = batches[1]["rollout_expert_indices"]
    if value == "duplicate":
        value = int(routes[1, 7, 1, 1])
    _set_expert(batches[1], 1, 7, 1, 0, value)
    forwards, handle = _count_forwards(model)
    with pytest.raises(ValueError, match=rf"microbatch 1, layer 1: row 1, token 7: {what}"):
        run_step(hook, model, batches)
    handle.remove()
    assert len(forwards) == 1  # microbatch 0 ran; microbatch 1 never reached the model
    assert all(r.replay.replay_backward_list == [] and r.replay.target_topk_idx is None for r in hook._routers)


def test_filler_routes_on_uncaptured_tokens_are_not_checked_when_they_route_live(make_model):
    model = make_model()
    batches = _two_microbatches()
    _set_expert(batches[0], 1, 0, 0, 0, -1)  # row 1 token 0 is left padding (uncaptured)
    with ReplayHook(model) as hook:  # uncaptured="live": the filler is never used
        run_step(hook, model, batches)
    with ReplayHook(model, uncaptured="replay") as hook:  # replayed: it must be a valid route
        with pytest.raises(ValueError, match=r"microbatch 0, layer 0: row 1, token 0: expert id -1 outside"):
            run_step(hook, model, batches)


def test_packed_layout_errors_name_the_sequence_and_its_token(make_model):
    model = make_model()
    padded = make_batch(batch=1, real=(16,), captured=(16,))
    batch = {
        "rollout_expert_indices": padded["rollout_expert_indices"][0].clone(),
        "router_padding_mask": padded["router_padding_mask"][0],
        "cu_seqlens": torch.tensor([0, 7, 16], dtype=torch.int32),
        "input_ids": padded["input_ids"],
        "attention_mask": padded["attention_mask"],
    }
    batch["rollout_expert_indices"][9, 1, 1] = 200  # sequence 1, token 2
    with ReplayHook(model) as hook:
        with pytest.raises(ValueError, match=r"microbatch 0, layer 1: sequence 1, token 2: expert id 200"):
            run_step(hook, model, [batch])


def _one_token_short(batch):
    return {
        **batch,
        "rollout_expert_indices": batch["rollout_expert_indices"][:, 1:],
        "router_padding_mask": batch["router_padding_mask"][:, 1:],
    }


def test_routes_one_token_short_are_refused_before_the_model_runs(make_model):
    model = make_model()
    hook = ReplayHook(model)
    forwards, handle = _count_forwards(model)
    with pytest.raises(ValueError, match=r"microbatch 0, layer 0: .*15 positions per row.*16.*row 0, token 15"):
        run_step(hook, model, [_one_token_short(make_batch())])
    handle.remove()
    assert forwards == []


def test_routes_one_token_short_are_refused_when_the_caller_passes_padding_mask(make_model):
    model = make_model()
    hook = ReplayHook(model)

    def step_with_own_mask(data_iterator, m):
        batch = next(data_iterator)
        ids = batch["input_ids"]
        full = torch.zeros(ids.shape, dtype=torch.bool)
        return m(ids, torch.arange(ids.shape[1]).expand_as(ids), None, padding_mask=full), lambda out: (out.sum(), {})

    with pytest.raises(ValueError, match=r"microbatch 0, layer 0: .*15 positions per row.*16"):
        run_step(hook, model, [_one_token_short(make_batch())], step=step_with_own_mask, forward_only=True)


def test_routes_one_token_short_are_refused_at_the_router_when_the_model_gets_decoder_input(make_model):
    model = make_model()
    hook = ReplayHook(model)
    checked = []

    def step_with_decoder_input(data_iterator, m):
        batch = next(data_iterator)
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        hidden = m.embedding(input_ids=ids, position_ids=positions)  # [S, B, H], as a later stage gets it
        checked.append(hidden.shape)
        return m(None, None, None, decoder_input=hidden), lambda out: (out.sum(), {})

    short = _one_token_short(make_batch())
    del short["attention_mask"]  # a later stage may get no token keys: only the router can tell
    with pytest.raises(
        ValueError,
        match=r"microbatch 0, layer 0: the router sees 32 tokens, the routes cover 30 \(2 rows x 15 positions",
    ):
        run_step(hook, model, [short], step=step_with_decoder_input, forward_only=True)
    assert checked  # the model ran up to the router
    assert all(r.replay.replay_backward_list == [] for r in hook._routers)


def test_an_exhausted_data_iterator_raises_valueerror_never_stopiteration(make_model):
    model = make_model()
    hook = ReplayHook(model)
    batches = _two_microbatches()
    finished = []
    for _ in range(1):  # a StopIteration escaping would silently end this loop
        with pytest.raises(ValueError, match="asked for microbatch 3 of 3, 2 arrived"):
            run_step(hook, model, batches, num_microbatches=3)
        finished.append(True)
    assert finished == [True]
    with pytest.raises(ValueError, match=r"asked for microbatch 1 \(the first\), none arrived"):
        with hook.step():
            hook.wrap_forward_step(forward_step)(iter([]), model)


def test_a_forward_step_that_reads_two_microbatches_raises_runtimeerror(make_model):
    model = make_model()
    hook = ReplayHook(model)

    def greedy(data_iterator, m):
        next(data_iterator)
        return forward_step(data_iterator, m)

    with pytest.raises(RuntimeError, match="called next.. on the data iterator more than once"):
        run_step(hook, model, _two_microbatches(), step=greedy)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
@pytest.mark.parametrize(
    "token, layer, fault",
    [
        (0, 0, "range"),  # the first route of the batch
        (15, 1, "range"),  # the last route: last token, last layer
        (15, 1, "repeat"),
        (8, 0, "repeat"),
        (6, 1, "tagbit"),  # an id that differs from the next route's only in bit 7 (uint8) or the sign (int16)
        (15, 1, "tagbit"),
    ],
)
def test_the_packed_check_names_the_first_bad_route_at_the_batch_edges(make_model, dtype, token, layer, fault):
    """The whole-tensor check tells neighbouring routes apart by their top bit: faults next to that bit, at the edges."""
    model = make_model()
    padded = make_batch(batch=1, real=(16,), captured=(16,), dtype=dtype)
    routes = padded["rollout_expert_indices"][0].clone()  # [16, 2 layers, K=2]
    batch = {
        "rollout_expert_indices": routes,
        "router_padding_mask": padded["router_padding_mask"][0],
        "cu_seqlens": torch.tensor([0, 7, 16], dtype=torch.int32),
        "input_ids": padded["input_ids"],
        "attention_mask": padded["attention_mask"],
    }
    flat = routes.view(-1, routes.shape[-1])
    row = token * routes.shape[1] + layer
    if fault == "range":
        value = EXPERTS
        routes[token, layer, 1] = value
    elif fault == "repeat":
        value = int(routes[token, layer, 1])
        routes[token, layer, 0] = value
    else:  # the next route (or, for the last, the one before) holds this id's low bits
        other = row + 1 if row + 1 < flat.shape[0] else row - 1
        top = 0x80 if dtype == torch.uint8 else -0x8000
        value = int(flat[other, 0]) ^ top
        routes[token, layer, 1] = value
    sequence, position = (0, token) if token < 7 else (1, token - 7)
    what = rf"expert id {value} " + ("twice in one route" if fault == "repeat" else rf"outside \[0, {EXPERTS}\)")
    with ReplayHook(model) as hook:
        with pytest.raises(
            ValueError, match=rf"microbatch 0, layer {layer}: sequence {sequence}, token {position}: {what}"
        ):
            run_step(hook, model, [batch])
