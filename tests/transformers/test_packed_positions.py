"""The transformers guide's one-line `position_ids` for a packed batch are Hugging Face's own.

`DataCollatorWithFlattening` (transformers' collator for padding-free training) is the
reference: on the same trajectories, its `input_ids` and `position_ids` must equal the
packed `R3Collator` batch's tokens and the guide's recipe applied to its `cu_seqlens`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening

from torch_r3 import R3Collator

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "transformers.md"
RECIPE = "position_ids = (torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], cu.diff()))[None]"


def test_the_guide_gives_the_recipe_tested_here():
    assert RECIPE in GUIDE.read_text()


@pytest.mark.parametrize("lengths", [(3, 5, 2), (1,), (7, 1, 1, 4), tuple(range(1, 30))])
def test_the_recipe_gives_the_position_ids_of_data_collator_with_flattening(lengths):
    rng = np.random.default_rng(len(lengths))
    samples = [
        {
            "input_ids": rng.integers(1, 1000, n).tolist(),
            "routes": rng.random((n - 1, 2, 8)).argsort(-1)[..., :2].astype(np.uint8),
        }
        for n in lengths
    ]
    batch = R3Collator(layout="packed", pad_token_id=0)(samples)
    namespace = {"torch": torch, "cu": batch["cu_seqlens"].long()}
    exec(RECIPE, namespace)
    hf = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s["input_ids"]} for s in samples])
    assert torch.equal(batch["input_ids"][None], hf["input_ids"])
    assert torch.equal(namespace["position_ids"], hf["position_ids"])
