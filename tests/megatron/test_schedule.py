"""`torch_r3.megatron.schedule.next_recompute`: the recompute queue both Megatron hooks pop."""

from __future__ import annotations

import pytest

from torch_r3.megatron.schedule import next_recompute


def test_recompute_takes_the_oldest_entry_first():
    queue = ["first", "second"]
    assert next_recompute(queue, "unused") == "first"
    assert next_recompute(queue, "unused") == "second"
    assert queue == []


def test_the_refusal_is_formatted_from_its_pieces_only_when_the_queue_is_empty():
    queue = [1]
    # A template whose field is missing would raise KeyError if it were formatted: it is not.
    assert next_recompute(queue, "layer {missing}") == 1
    with pytest.raises(RuntimeError) as err:
        next_recompute(queue, "layer {layer}: {pushes} installed", layer=3, pushes=2)
    assert str(err.value) == "layer 3: 2 installed"
