"""Messages that name the fix that works (issue 45, item 4).

A layer-major `[layers, rows, topk]` array refused for its shape, a sample whose routes sit under another key,
a padding side given as the layout, and a JSON file that is no run log: each is refused
with a message that says what was given and the spelling that works.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from torch_r3 import Padded, R3Collator, collate_routes
from torch_r3.cli import main

L, K = 4, 2


def _routes(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, L, 16)), axis=-1)[..., :K].astype(np.uint8)


def _layer_major(n: int, seed: int) -> np.ndarray:
    """A trajectory of `n` tokens' routes, [layers, rows, topk]: the transpose of what the collator takes."""
    return _routes(n - 1, seed).transpose(1, 0, 2).copy()


TRANSPOSED = r"is the array \[layers, rows, topk\]\?"


def test_a_layer_major_batch_of_unequal_lengths_is_named_as_such():
    with pytest.raises(ValueError, match=rf"routes\[1\]: expected \[rows, 4, 2\].*{TRANSPOSED}"):
        collate_routes([_layer_major(5, 0), _layer_major(9, 1)], [5, 9])


def test_the_hint_follows_its_advice_and_never_refuses_on_its_own():
    # An equal-length batch whose arrays fit both readings is valid as [rows, layers, topk]:
    # 2 captured rows of 4 layers for 5 tokens (a partial capture). The shapes cannot tell.
    batch = collate_routes([_routes(2, 0), _routes(2, 1)], [5, 5])
    assert tuple(batch["rollout_expert_indices"].shape) == (2, 5, L, K)
    arrays = [_layer_major(5, 0), _layer_major(9, 1)]
    fixed = collate_routes([a.transpose(1, 0, 2) for a in arrays], [5, 9])  # the hint's advice
    want = collate_routes([_routes(4, 0), _routes(8, 1)], [5, 9])
    assert all(np.array_equal(fixed[k].numpy(), want[k].numpy()) for k in want)
    # A shape that does not fit the layer-major reading gets no such hint.
    with pytest.raises(
        ValueError, match=r"routes\[1\]: expected \[rows, 4, 2\] like routes\[0\], got shape \(3, 4, 1\)$"
    ):
        collate_routes([_routes(4, 0), np.zeros((3, 4, 1), np.uint8)], [5, 5])


def test_a_sample_whose_routes_sit_under_another_key_is_pointed_at_routes_key():
    sample = {"input_ids": [1, 2, 3], "routed_experts": _routes(2, 0)}
    with pytest.raises(ValueError, match=r"missing key 'routes'.*'routed_experts'.*R3Collator\(routes_key=\.\.\.\)"):
        R3Collator(pad_token_id=0)([sample])
    assert R3Collator(pad_token_id=0, routes_key="routed_experts")([sample])["rollout_expert_indices"].shape[1] == 3
    with pytest.raises(ValueError, match=r"missing key 'input_ids'.*R3Collator\(tokens_key=\.\.\.\)"):
        R3Collator(pad_token_id=0)([{"tokens": [1, 2, 3], "routes": _routes(2, 0)}])


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padding_side_given_as_the_layout_names_padded_side(side):
    with pytest.raises(ValueError, match=rf"layout='{side}' names a padding side.*torch_r3\.Padded\(side='{side}'\)"):
        R3Collator(pad_token_id=0, layout=side)
    assert R3Collator(pad_token_id=0, layout=Padded(side=side)).layout.side == side


def test_report_on_a_json_file_that_is_no_run_log_says_what_it_reads(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": "qwen", "layers": 48}, indent=2))  # pretty-printed: not one object per line
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a JSON line" in err and "torch_r3.runlog.RunLog" in err, err
