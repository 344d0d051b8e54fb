"""Replay for sparse attention: DeepSeek Sparse Attention's indexer top-k, from the engine to the trainer.

DSA models (DeepSeek-V3.2, GLM-5-class) make a second discrete choice per token
beside the MoE router: each attention layer's lightning indexer picks the
`index_topk` earlier positions the token attends to. This package carries those
selections the way `torch_r3` carries routes:

* `IndexerSelections` (`torch_r3.indexer.encoding`): one trajectory's
  selections in compact form;
* `decode_sglang_indexer_topk` (`torch_r3.indexer.wire`): SGLang's
  `meta_info.indexer_topk`, bounded before allocating, streamed into that form;
* `collate_selections` (`torch_r3.indexer.collate`): a batch's selections in
  the padded or packed layout, positions shifted to batch coordinates;
* the checks every replay makes (`torch_r3.indexer.checks`), and the
  `transformers` hooks (`torch_r3.indexer.transformers`, which alone imports
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

from torch_r3.indexer.collate import SELECTION_MASK, SELECTIONS, collate_selections
from torch_r3.indexer.encoding import FILL, IndexerSelections, SelectionEncoder
from torch_r3.indexer.wire import decode_sglang_indexer_topk

__all__ = [
    "FILL",
    "SELECTIONS",
    "SELECTION_MASK",
    "IndexerSelections",
    "SelectionEncoder",
    "collate_selections",
    "decode_sglang_indexer_topk",
]
