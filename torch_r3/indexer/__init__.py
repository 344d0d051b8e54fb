"""Replay for sparse attention: DeepSeek Sparse Attention's indexer top-k, from the engine to the trainer.

DSA models (DeepSeek-V3.2, GLM-5-class) make a second discrete choice per token
beside the MoE router: each attention layer's lightning indexer picks the
`index_topk` earlier positions the token attends to. This package carries those
selections the way `torch_r3` carries routes:

* `IndexerSelections` (`torch_r3.selections`): one trajectory's
  selections in compact form;
* `decode_sglang_indexer_topk` (`torch_r3.rollout.selections_wire`): SGLang's
  `meta_info.indexer_topk`, bounded before allocating, streamed into that form;
* `collate_selections` (`torch_r3.collate.selections`): a batch's selections in
  the padded or packed layout, positions shifted to batch coordinates;
* the checks every replay makes (`torch_r3.replay.selection_checks`), and the
  `transformers` hooks (`torch_r3.transformers.indexer`, which alone imports
  `transformers`).

Examples:
    >>> import numpy as np
    >>> from torch_r3.indexer import IndexerSelections, collate_selections
    >>> sel = IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 1]]]))
    >>> from torch_r3 import Padded
    >>> collate_selections([sel], [4], layout=Padded(seq_len=5))["rollout_indexer_topk"][0, :, 0].tolist()
    [[-1, -1], [1, -1], [1, 2], [2, 3], [-1, -1]]
"""

from __future__ import annotations

from torch_r3.collate.selections import SELECTION_MASK, SELECTIONS, collate_selections
from torch_r3.rollout.selections_wire import decode_sglang_indexer_topk
from torch_r3.selections import FILL, IndexerSelections, SelectionEncoder

__all__ = [
    "FILL",
    "SELECTIONS",
    "SELECTION_MASK",
    "IndexerSelections",
    "SelectionEncoder",
    "collate_selections",
    "decode_sglang_indexer_topk",
]
