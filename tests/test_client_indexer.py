"""Indexer selections end to end: the loopback SGLang server answers `return_indexer_topk` from real DSA
indexers, and the client requests, checks and decodes them into `IndexerSelections`."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from torch_r3.indexer import IndexerSelections
from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError
from torch_r3.testing import LoopbackServer, TinyMoELM

pytest.importorskip("transformers")

from torch_r3.testing.indexer import IndexerLM

K = 4


def _run(server, prompt, *, indexer_layers=2, index_topk=K, **kwargs):
    async def main():
        async with RemoteGenerateClient(
            server.url, server="sglang", num_layers=2, topk=2, indexer_layers=indexer_layers, index_topk=index_topk
        ) as client:
            return await client.generate(prompt, {"max_new_tokens": 5}, **kwargs)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def lm():
    return IndexerLM(num_layers=2, index_topk=K, vocab_size=64, shared=(1,))


def test_the_client_decodes_what_the_servers_indexers_selected(lm):
    with LoopbackServer(TinyMoELM(), protocol="sglang", sglang_indexer=lm) as server:
        prompt = [5, 9, 3, 7, 11, 2, 8, 4]
        result = _run(server, prompt, return_indexer_topk=True, return_routed_experts=True)
    seen = prompt + list(result.response_ids)
    assert isinstance(result.indexer_topk, IndexerSelections)
    assert result.indexer_topk.shape == (len(seen) - 1, 2, K)
    assert result.indexer_topk.layer_source == (0, 0)  # the shared layer is stored once
    want = IndexerSelections.from_dense(lm.select(seen)[:-1]).to_dense()
    np.testing.assert_array_equal(result.indexer_topk.to_dense(), want)
    assert "indexer_topk" not in result.raw["meta_info"]  # the payload is not kept twice
    assert result.routed_experts.shape[0] == len(seen) - 1


def test_without_the_flag_there_are_no_selections(lm):
    with LoopbackServer(TinyMoELM(), protocol="sglang", sglang_indexer=lm) as server:
        assert _run(server, [5, 9, 3]).indexer_topk is None
    with LoopbackServer(TinyMoELM(), protocol="sglang") as server:  # launched without the server flag
        with pytest.raises(RemoteGenerateError, match="no 'indexer_topk' in meta_info .*--enable-return-indexer-topk"):
            _run(server, [5, 9, 3], return_indexer_topk=True)


def test_a_wrong_shape_is_refused_as_a_format_error(lm):
    with LoopbackServer(TinyMoELM(), protocol="sglang", sglang_indexer=lm) as server:
        with pytest.raises(RemoteGenerateError, match="breaks the sglang format: meta_info.indexer_topk"):
            _run(server, [5, 9, 3, 4, 5, 6], return_indexer_topk=True, indexer_layers=3)


def test_misuse_is_refused_before_sending():
    with LoopbackServer(TinyMoELM()) as server:

        async def main(flag=True, **kwargs):
            async with RemoteGenerateClient(server.url, **kwargs) as client:
                return await client.generate([1, 2], {"max_new_tokens": 1}, return_indexer_topk=flag)

        with pytest.raises(ValueError, match="only SGLang returns indexer selections"):
            asyncio.run(main())
        with pytest.raises(ValueError, match="indexer_layers= .* and index_topk="):
            asyncio.run(main(server="sglang", num_layers=2, topk=2))
        with pytest.raises(TypeError, match="return_indexer_topk must be True or False, got 1"):
            asyncio.run(main(1))


def test_a_non_causal_row_from_the_server_is_a_format_error(lm):
    class Bad:
        def select(self, tokens):
            out = lm.select(tokens)
            out[-2, 0, 0] = len(tokens)  # a future position
            return out

    with LoopbackServer(TinyMoELM(), protocol="sglang", sglang_indexer=Bad()) as server:
        with pytest.raises(RemoteGenerateError, match="after the query itself"):
            _run(server, [5, 9, 3, 4, 5, 6], return_indexer_topk=True)
