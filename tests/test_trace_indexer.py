"""`RoutedExpertTrace` carries DSA indexer selections across turns: SGLang (here the loopback server with real
indexers) resends every row each turn; the trace checks the resent rows and keeps the latest turn's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.reference_selections import random_capture, sorted_rows
from torch_r3 import RoutedExpertTrace
from torch_r3.indexer import IndexerSelections
from torch_r3.rollout.client import RemoteGenerateClient
from torch_r3.rollout.selections_trace import SelectionTurns
from torch_r3.testing import LoopbackServer, TinyMoELM

pytest.importorskip("transformers")

from torch_r3.testing.indexer import IndexerLM

K = 4


@pytest.fixture(scope="module")
def lm():
    return IndexerLM(num_layers=2, index_topk=K, vocab_size=64, shared=(1,))


class Recomputing:
    """An engine whose second answer recomputes row 6 of the prefix with another selection."""

    def __init__(self, lm):
        self.lm, self.calls = lm, 0

    def select(self, tokens):
        out = self.lm.select(tokens)
        self.calls += 1
        if self.calls >= 2:
            out[6, 0] = np.arange(6 - K + 1, 7)[::-1]  # the K latest positions: causal, distinct, different
            out[6, 1] = out[6, 0]
        return out


def _rollout(server, trace, turns=3, observation=(7, 3)):
    """Three turns through the client; returns the trajectory's tokens."""

    async def main():
        tokens = [5, 9, 3, 7, 11, 2, 8, 4]
        async with RemoteGenerateClient(
            server.url, server="sglang", num_layers=2, topk=2, indexer_layers=2, index_topk=K
        ) as client:
            for turn in range(turns):
                result = await client.generate(
                    tokens,
                    {"max_new_tokens": 4, "sampling_seed": turn},
                    return_routed_experts=True,
                    routed_experts_prompt_start=trace.prompt_start,
                    return_indexer_topk=True,
                )
                trace.record_result(result, prompt_len=len(tokens))
                tokens = tokens + list(result.response_ids) + list(observation)
        return tokens[: len(tokens) - len(observation)]

    return asyncio.run(main())


def test_three_turns_give_the_whole_trajectory_s_selections_beside_its_routes(lm):
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    with LoopbackServer(TinyMoELM(), protocol="sglang", sglang_indexer=lm) as server:
        tokens = _rollout(server, trace)
    routes = trace.finalize(len(tokens))
    sel = trace.indexer_topk
    assert trace.turns == 3 and isinstance(sel, IndexerSelections)
    assert sel.rows == routes.shape[0] == len(tokens) - 1  # one row per evaluated position, like the routes
    # Independent of the trace: the real indexers over the whole trajectory.
    np.testing.assert_array_equal(sel.to_dense(), sorted_rows(lm.select(tokens)[:-1]))
    assert trace.selections_changed == 0


def test_a_resent_row_that_changed_is_refused_by_default_and_counted_with_latest(lm):
    trace = RoutedExpertTrace(num_layers=2, topk=2)
    with LoopbackServer(TinyMoELM(), protocol="sglang", sglang_indexer=Recomputing(lm)) as server:
        with pytest.raises(ValueError, match=r"turn 1: the engine resent 1 indexer row\(s\) .* row 6"):
            _rollout(server, trace)
    assert trace.turns == 1 and trace.indexer_topk.rows == trace.prompt_start  # turn 1 left nothing behind

    trace = RoutedExpertTrace(num_layers=2, topk=2, resent_selections="latest")
    with LoopbackServer(TinyMoELM(), protocol="sglang", sglang_indexer=Recomputing(lm)) as server:
        tokens = _rollout(server, trace)
    want = lm.select(tokens)[:-1]
    want[6] = np.arange(6 - K + 1, 7)
    np.testing.assert_array_equal(trace.indexer_topk.to_dense(), sorted_rows(want))
    assert trace.selections_changed == 1  # changed on turn 1, then resent unchanged on turn 2


def test_selections_on_some_turns_only_the_wrong_rows_and_a_wrong_type_are_refused():
    rng = np.random.default_rng(0)
    routes = rng.integers(1, 5, (40, 1, 2))
    sel = IndexerSelections.from_dense(random_capture(rng, 40, 2, K))
    trace = RoutedExpertTrace()
    trace.record(prompt_len=6, generated_len=2, routes=routes[:7])
    with pytest.raises(ValueError, match="came with 0 of the 1 earlier turns and with this one"):
        trace.record(prompt_len=10, generated_len=2, routes=routes[7:11], indexer_topk=sel)
    trace = RoutedExpertTrace()
    first = IndexerSelections.from_dense(random_capture(rng, 7, 2, K))
    trace.record(prompt_len=6, generated_len=2, routes=routes[:7], indexer_topk=first)
    with pytest.raises(ValueError, match="came with 1 of the 1 earlier turns and not with this one"):
        trace.record(prompt_len=10, generated_len=2, routes=routes[7:11])
    with pytest.raises(ValueError, match="indexer_topk has 40 rows, expected 11"):
        trace.record(prompt_len=10, generated_len=2, routes=routes[7:11], indexer_topk=sel)
    with pytest.raises(TypeError, match="indexer_topk must be IndexerSelections .* got ndarray"):
        trace.record(prompt_len=10, generated_len=2, routes=routes[7:11], indexer_topk=np.zeros((11, 2, K)))
    assert trace.turns == 1 and trace.prompt_start == 7  # each refusal left the trace as it was
    with pytest.raises(ValueError, match="resent_selections must be one of"):
        RoutedExpertTrace(resent_selections="first")


def test_selection_turns_compares_codes_and_rows_across_exception_dtypes():
    """The same rows coded with uint16 exceptions (<= 65536 rows) and uint32 (more) still compare equal."""
    rng = np.random.default_rng(1)
    K2 = 2
    dense = np.full((65540, 1, K2), -1, dtype=np.int32)
    dense[0, 0, 0] = 0
    j = np.arange(1, 65540)
    dense[1:, 0, 0], dense[1:, 0, 1] = 0, j  # the first and the query's own position: one big gap per row
    dense[1, 0] = [0, 1]
    short = IndexerSelections.from_dense(dense[:65536])
    long = IndexerSelections.from_dense(dense)
    assert short.differing_rows(long, 65536).size == 0
    turns = SelectionTurns()
    turns.add(short, rows=65536)
    changed = dense.copy()
    changed[40000, 0, 0] = int(rng.integers(1, 39999))
    turns_latest = SelectionTurns(resent="latest")
    turns_latest.add(short, rows=65536)
    turns_latest.add(IndexerSelections.from_dense(changed), rows=65540)
    assert turns_latest.changed == 1
    with pytest.raises(ValueError, match=r"resent 1 indexer row\(s\) .*row 40000"):
        turns.add(IndexerSelections.from_dense(changed), rows=65540)
    turns.add(long, rows=65540)
    assert turns.selections is long and turns.turns == 2
