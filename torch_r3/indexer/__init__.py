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
  the padded or packed layout, positions shifted to batch coordinates.
"""

from __future__ import annotations

from torch_r3.indexer.encoding import FILL, IndexerSelections, SelectionEncoder

__all__ = ["FILL", "IndexerSelections", "SelectionEncoder"]
