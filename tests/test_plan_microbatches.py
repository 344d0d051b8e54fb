"""`plan_microbatches` plans a rank's step in O(n log n), with the guarantees it always gave.

The reference below is the planner as it stood before (every micro-batch count tried in
turn, each sample placed by scanning every micro-batch): the new one must return the very
same plan on many random cases, since every rank computes the plan on its own and a plan
that changed between releases would change what a step trains on. How fast it is, is a
benchmark's job (`benchmarks/plan_bench.py`); here the work is counted, not timed: the
number of Python lines the planner executes, which does not depend on the machine.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import torch_r3.collate.shard
from torch_r3 import plan_microbatches


def _reference_split(members, counts, m, mbs, cap):
    bins = [[] for _ in range(m)]
    load = [0] * m
    for i in sorted(members, key=lambda i: (-counts[i], i)):
        room = [
            b for b in range(m) if (mbs is None or len(bins[b]) < mbs) and (cap is None or load[b] + counts[i] <= cap)
        ]
        if not room:
            return None
        b = min(room, key=lambda b: (load[b], len(bins[b]), b))
        bins[b].append(i)
        load[b] += counts[i]
    return [sorted(b) for b in bins]


def reference_plan(counts, dp, mbs=None, cap=None):
    """The planner before this change (cubic with a token cap, quadratic with a sample cap)."""
    members = [[] for _ in range(dp)]
    load = [0] * dp
    order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    for start in range(0, len(order), dp):
        chunk = order[start : start + dp]
        ranks = sorted(range(dp), key=lambda r: (load[r], r))[: len(chunk)]
        for i, r in zip(chunk, ranks):
            members[r].append(i)
            load[r] += counts[i]
    m = 1
    if mbs is not None:
        m = max(m, -(-max(len(ms) for ms in members) // mbs))
    if cap is not None:
        m = max(m, -(-max(load) // cap))
    fewest = min(len(ms) for ms in members)
    while m <= fewest:
        plan = [_reference_split(ms, counts, m, mbs, cap) for ms in members]
        if all(p is not None for p in plan):
            return plan
        m += 1
    return None


def _cases(n_cases: int):
    rng = np.random.default_rng(26)
    for _ in range(n_cases):
        n = int(rng.integers(1, 60))
        dp = int(rng.integers(1, min(n, 4) + 1))
        kind = rng.integers(0, 4)
        if kind == 0:  # RL-like lengths
            counts = rng.integers(1, 200, n)
        elif kind == 1:  # a few lengths, many ties
            counts = rng.choice([3, 5, 8, 13], n)
        elif kind == 2:  # long tail
            counts = np.minimum(1 + rng.geometric(0.05, n), 400)
        else:  # just over half of a cap: every micro-batch holds one
            counts = rng.integers(51, 60, n)
        mbs = None if rng.random() < 0.3 else int(rng.integers(1, 6))
        cap = None if rng.random() < 0.3 else int(counts.max() + rng.integers(0, 150))
        if kind == 3 and rng.random() < 0.7:
            cap = 100
        yield counts.tolist(), dp, mbs, cap


def test_the_plan_is_the_reference_planner_s_on_random_cases():
    compared = refused = 0
    for counts, dp, mbs, cap in _cases(1500):
        want = reference_plan(counts, dp, mbs, cap)
        if want is None:
            with pytest.raises(ValueError, match="need more micro-batches per rank"):
                plan_microbatches(counts, dp_size=dp, micro_batch_size=mbs, max_tokens_per_microbatch=cap)
            refused += 1
            continue
        got = plan_microbatches(counts, dp_size=dp, micro_batch_size=mbs, max_tokens_per_microbatch=cap)
        assert got == want, (counts, dp, mbs, cap)
        compared += 1
    assert compared > 1000 and refused > 20  # both outcomes were exercised


def test_the_plan_keeps_its_guarantees_at_scale():
    rng = np.random.default_rng(7)
    counts = rng.integers(200, 8192, 4096).tolist()
    cap = 16384
    plan = plan_microbatches(counts, dp_size=8, micro_batch_size=8, max_tokens_per_microbatch=cap)
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(counts)))
    assert len({len(rank) for rank in plan}) == 1  # the same count on every rank
    for rank in plan:
        for mb in rank:
            assert mb and mb == sorted(mb) and len(mb) <= 8 and sum(counts[i] for i in mb) <= cap
    # One fewer micro-batch per rank cannot hold the rank's tokens under the cap.
    heaviest = max(sum(counts[i] for mb in rank for i in mb) for rank in plan)
    assert len(plan[0]) >= -(-heaviest // cap)


def _lines_run(fn) -> int:
    """Lines of `torch_r3/collate/shard.py` that `fn()` executes: a count of work, independent of the machine."""
    target = torch_r3.collate.shard.__file__
    n = 0

    def local(frame, event, arg):
        nonlocal n
        if event == "line":
            n += 1
        return local

    def top(frame, event, arg):
        return local if frame.f_code.co_filename == target else None

    sys.settrace(top)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


@pytest.mark.parametrize(
    "limits, counts_of",
    [
        # Trajectories just over half the token cap: each micro-batch holds one.
        ({"max_tokens_per_microbatch": 100}, lambda n: [51 + i % 7 for i in range(n)]),
        ({"micro_batch_size": 1}, lambda n: [10 + i % 13 for i in range(n)]),
    ],
    ids=["token-cap", "one-sample-each"],
)
def test_planning_work_grows_like_n_log_n(limits, counts_of):
    small, large = 32, 256  # 8x the samples
    work = [_lines_run(lambda n=n: plan_microbatches(counts_of(n), dp_size=2, **limits)) for n in (small, large)]
    # n log n: about 8 x 8/5 = 13x; the quadratic planner did 64x, the cubic one 512x.
    assert work[1] / work[0] < 20, work
