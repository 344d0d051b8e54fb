"""The replayed-rows check's fingerprint against rows that differ in a structured, small way (issue 43.3).

The check remembers fingerprints of earlier responses' route rows and refuses a response whose rows
repeat them behind other tokens. A fingerprint that is linear over 64-bit words loses every bit of a
difference but the top eight when the difference sits in a word's top byte: two such differences
(the 8th expert of layer 0 and of layer 1, top-8 `uint8` ids, one 64-bit word per layer) then cancel
for one choice in 256, and a response whose every row differs was refused as a replay. Each case
here changes every row of an earlier response, so the reference is plain: the rows differ
(`np.any(a != b)` per row), hence no finding; and the same rows unchanged behind other tokens are
refused, so the check is live.
"""

from __future__ import annotations

import numpy as np
import pytest

from torch_r3.health.check import RouteHealthCheck, RouteHealthError

ROWS, TOPK = 32, 8


def first_response(rng, layers, experts, dtype, last):
    """Top-8 rows, ids distinct per row: the first 7 drawn below `experts // 2`, the 8th `last` in every row."""
    keys = rng.random((ROWS, layers, experts // 2))
    routes = np.argsort(keys, axis=2)[:, :, : TOPK - 1].astype(dtype)
    tail = np.full((ROWS, layers, 1), last, dtype)
    return np.concatenate([routes, tail], axis=2)


def refused(check, routes, tokens, name):
    try:
        check.check(routes, trajectory=name, token_ids=tokens)
    except RouteHealthError as e:
        return e
    return None


def sweep(layers, experts, dtype, changed, shifts, slot=TOPK - 1):
    """Response A, then for each pair of shifts one response B: A with the `slot`th expert of the `changed` layers moved.

    One `RouteHealthCheck` (the client's default, `raise`) sees them all, as a client sees its
    responses: every B differs from A and from every other B in every row.
    """
    rng = np.random.default_rng(43)
    last = experts - 1
    a = first_response(rng, layers, experts, dtype, last)
    if slot != TOPK - 1:
        a[:, :, [slot, TOPK - 1]] = a[:, :, [TOPK - 1, slot]]
    tokens_a = rng.integers(3, 30000, ROWS)
    live = RouteHealthCheck(num_experts=experts)
    live.check(a, trajectory="A", token_ids=tokens_a)
    assert refused(live, a.copy(), rng.integers(3, 30000, ROWS), "A again") is not None  # the check is live
    check = RouteHealthCheck(num_experts=experts)
    check.check(a, trajectory="A", token_ids=tokens_a)
    wrong = []
    for s0 in shifts:
        for s1 in shifts:
            b = a.copy()
            b[:, changed[0], slot] = last - s0
            b[:, changed[1], slot] = last - s1
            assert np.any(b != a, axis=(1, 2)).all()  # every row of B differs from A's
            ids = np.sort(b, axis=2)
            assert (ids[:, :, 1:] != ids[:, :, :-1]).all()  # each row's ids still distinct
            error = refused(check, b, rng.integers(3, 30000, ROWS), f"B{s0},{s1}")
            if error is not None:
                wrong.append((s0, s1, str(error)))
    return wrong


def test_the_8th_expert_of_layers_0_and_1_changed_in_every_row_is_no_replay():
    # The case: top-8 uint8 ids, each layer one 64-bit word, the 8th expert its top byte.
    wrong = sweep(layers=2, experts=128, dtype=np.uint8, changed=(0, 1), shifts=range(1, 64, 2))
    assert wrong == [], f"{len(wrong)} of {32 * 32} refused, e.g. {wrong[0]}"


@pytest.mark.parametrize(
    "layers, experts, dtype, changed, slot",
    [
        (48, 128, np.uint8, (0, 1), TOPK - 1),  # Qwen3-30B-A3B's 48 layers
        (6, 256, np.uint8, (3, 5), TOPK - 1),  # the top bytes of two other, non-adjacent words
        (4, 64, np.uint8, (0, 2), 3),  # the top byte of a 32-bit half (the 4th expert)
        (3, 1024, np.int16, (0, 1), TOPK - 1),  # int16 ids: the high byte of the word's last id
    ],
    ids=["uint8-48-layers", "uint8-other-words", "uint8-4th-expert", "int16"],
)
def test_other_structured_changes_in_every_row_are_no_replay(layers, experts, dtype, changed, slot):
    step = 2 if layers < 8 else 4
    shifts = range(1, experts // 2, step) if experts <= 256 else range(256, 512, 9)  # int16: differences past 255
    wrong = sweep(layers=layers, experts=experts, dtype=dtype, changed=changed, shifts=shifts, slot=slot)
    assert wrong == [], f"{len(wrong)} refused, e.g. {wrong[0]}"
