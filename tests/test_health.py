"""Engine-health checks: the capture-bug signatures are refused, routes drawn like a real router's never are.

Healthy routes come from two independent sources: a real `transformers` Qwen3-MoE
router (random weights, random and degenerate inputs, a dense layer that sends zero
rows as the engines do) and Zipf-skewed top-k draws. The broken ones are made from
healthy ones the way the engine bugs made them: a layer left zero (an uncaptured
layer, a pipeline stage), a layer stuck on one row, a run of rows replaced by one
row of another request (stale padded capture slots).
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

from tests.samples import router_routes
from torch_r3 import RoutedExpertTrace, compact_routes
from torch_r3.health.check import (
    RouteHealthCheck,
    RouteHealthError,
    RouteHealthWarning,
    ZeroRoutesWarning,
    check_route_health,
)

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

LAYERS, EXPERTS, TOPK, DENSE = 4, 32, 4, 1  # layer 1 is dense: all-zero rows, as vLLM and SGLang send it
MOE_LAYERS = [0, 2, 3]


@pytest.fixture(scope="module")
def router_model():
    config = transformers.Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        num_hidden_layers=LAYERS,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        moe_intermediate_size=32,
        mlp_only_layers=[DENSE],
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def real_routes(model, tokens: list[int]) -> np.ndarray:
    """The routes the model's own routers choose, over every hidden layer (the dense one zero)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    routes = np.zeros((len(tokens), LAYERS, TOPK), np.int64)
    for layer, logits in zip(MOE_LAYERS, out.router_logits):
        routes[:, layer] = torch.topk(logits.reshape(len(tokens), EXPERTS), TOPK, dim=-1).indices.numpy()
    return routes


@pytest.mark.parametrize("n", [1, 2, 7, 64, 300, 1024])
def test_a_real_routers_routes_pass_at_every_length(router_model, n):
    rng = np.random.default_rng(n)
    tokens = rng.integers(3, 512, n).tolist()
    routes = real_routes(router_model, tokens)
    check = RouteHealthCheck(moe_layers=MOE_LAYERS)
    assert check.check(routes, trajectory="t", token_ids=tokens) == ()
    assert check.check(routes, trajectory="t") == ()  # without tokens (fewer checks), and with the dense layer
    assert compact_routes(routes).shape == routes.shape  # compact_routes' default check too
    assert check.stats.trajectories == 2 and check.stats.refused == 0


def test_a_repeated_token_has_identical_routes_and_passes(router_model):
    # One token over and over: identical hidden states at every position, so identical routes are healthy.
    tokens = [17] * 200
    routes = real_routes(router_model, tokens)
    assert (routes == routes[:1]).all()  # the premise: every layer is one row throughout
    assert RouteHealthCheck(moe_layers=MOE_LAYERS).check(routes, trajectory="t", token_ids=tokens) == ()
    compact_routes(routes)  # no tokens: constant everywhere is undecidable, so it passes


def test_degenerate_repetition_after_a_real_prompt_passes(router_model):
    rng = np.random.default_rng(5)
    tokens = rng.integers(3, 512, 40).tolist() + [9] * 160  # a rollout that loops on one token
    routes = real_routes(router_model, tokens)
    assert RouteHealthCheck(moe_layers=MOE_LAYERS).check(routes, trajectory="t", token_ids=tokens) == ()


@pytest.mark.parametrize("alpha", [0.8, 1.2, 2.0])
def test_zipf_skewed_routes_never_trip_a_check(alpha):
    rng = np.random.default_rng(int(alpha * 10))
    check = RouteHealthCheck(moe_layers=[0, 1, 2, 3])
    for n in [1, 3, 16, 65, 500, 4000] * 20:
        routes = router_routes(rng, n, 4, 4, num_experts=64, dtype=np.int64, skew=alpha)
        check.check(routes, trajectory="t", token_ids=rng.integers(0, 1000, n))
    assert check.stats.as_dict() == {**check.stats.as_dict(), "zero_rows": 0, "constant_layers": 0, "stale_rows": 0}


def test_an_all_zero_moe_layer_is_refused_naming_trajectory_layer_and_engine_setting(router_model):
    tokens = np.random.default_rng(1).integers(3, 512, 50).tolist()
    routes = real_routes(router_model, tokens)
    routes[:, 2] = 0  # the layer the FlashInfer monolithic kernel never captured
    check = RouteHealthCheck(moe_layers=MOE_LAYERS, engine="vllm")
    with pytest.raises(RouteHealthError, match=r"sample 7: layer 2: rows 0\.\.49 of 50 are all zero") as info:
        check.check(routes, trajectory="sample 7", token_ids=tokens)
    assert "--moe-backend triton" in str(info.value)
    assert [(f.kind, f.layer) for f in info.value.findings] == [("zero_rows", 2)]
    assert (check.stats.zero_rows, check.stats.refused) == (1, 1)


def test_every_layer_zero_is_refused_without_a_layer_map_even_for_one_token():
    # topk >= 2: an all-zero row repeats expert 0, which no router does; one row decides.
    with pytest.raises(RouteHealthError, match="every layer: rows 0..0 of 1 are all zero"):
        compact_routes(np.zeros((1, 3, 2), np.int64))
    with pytest.raises(RouteHealthError, match="every layer"):
        compact_routes(np.zeros((500, 48, 8), np.uint8), name="sample 3")
    assert compact_routes(np.zeros((1, 3, 2), np.int64), health=None).shape == (1, 3, 2)


def test_prompt_rows_zero_in_every_layer_are_refused():
    # SGLang's prefill/decode disaggregation once returned all-zero prompt rows.
    routes = router_routes(2, 80, 4, 4, num_experts=64, dtype=np.int64, skew=1.2)
    routes[:30] = 0
    with pytest.raises(RouteHealthError, match="rows 0..29 of 80 are all zero"):
        check_route_health(routes, engine="sglang")


def test_with_top1_a_few_expert_0_rows_are_undecidable_and_many_are_refused():
    one = np.zeros((1, 2, 1), np.uint8)
    assert check_route_health(one, moe_layers=[0, 1], token_ids=[5]) == ()  # one token routed to expert 0: fine
    rng = np.random.default_rng(3)
    routes = router_routes(rng, 100, 2, 1, num_experts=16, dtype=np.int64)
    popular = routes.copy()
    popular[:90, 1] = 0  # a skewed top-1 router sends most tokens to expert 0: a real choice
    assert check_route_health(popular, moe_layers=[0, 1]) == ()
    routes[:, 1] = 0
    with pytest.raises(RouteHealthError, match="layer 1"):
        check_route_health(routes, moe_layers=[0, 1])


def test_a_layer_stuck_on_one_row_is_refused_and_counted_in_every_mode(router_model):
    tokens = np.random.default_rng(4).integers(3, 512, 100).tolist()
    routes = real_routes(router_model, tokens)
    routes[:, 3] = [5, 9, 1, 30]
    with pytest.raises(RouteHealthError, match=r"t: layer 3: all 100 rows are \[5, 9, 1, 30\]"):
        check_route_health(routes, trajectory="t", token_ids=tokens)
    check = RouteHealthCheck("warn")
    with pytest.warns(RouteHealthWarning, match="constant_layer"):
        (finding,) = check.check(routes, trajectory="t")
    assert finding.kind == "constant_layer" and finding.layer == 3
    counted = RouteHealthCheck("count")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(counted.check(routes, trajectory="t")) == 1
    assert counted.stats.constant_layers == 1 and counted.stats.accepted_unhealthy == 1 and counted.stats.refused == 0


def test_a_few_rows_of_one_value_are_not_enough_to_call_a_layer_stuck():
    routes = router_routes(6, 63, 4, 4, num_experts=64, dtype=np.int64, skew=1.2)
    routes[:, 0] = [1, 2, 3, 4]
    assert check_route_health(routes, token_ids=np.arange(63)) == ()


def test_a_replayed_stale_row_from_another_request_is_refused(router_model):
    rng = np.random.default_rng(8)
    other = real_routes(router_model, rng.integers(3, 512, 30).tolist())
    tokens = rng.integers(3, 512, 120).tolist()
    routes = real_routes(router_model, tokens)
    routes[70:100] = other[12]  # padded capture slots kept one row of an earlier forward
    check = RouteHealthCheck(moe_layers=MOE_LAYERS, engine="sglang")
    with pytest.raises(RouteHealthError, match=r"every layer: rows 70\.\.99 repeat one row verbatim") as info:
        check.check(routes, trajectory="req 2", token_ids=tokens)
    assert "sglang#36404" in str(info.value) and check.stats.stale_rows == 1
    # The same run over one repeated token is what a looping rollout looks like: accepted.
    looped = list(tokens)
    looped[70:100] = [looped[70]] * 30
    assert check.check(routes, trajectory="req 2", token_ids=looped) == ()


@pytest.mark.parametrize("offset", [0, 37], ids=["same positions", "other positions"])
def test_rows_replayed_from_another_request_are_refused_naming_it(router_model, offset):
    rng = np.random.default_rng(20 + offset)
    first_tokens = rng.integers(3, 512, 160).tolist()
    first = real_routes(router_model, first_tokens)
    tokens = rng.integers(3, 512, 160).tolist()
    routes = real_routes(router_model, tokens)
    # Reused capture slots still held the first request's rows: 40 of them, behind other tokens.
    routes[50 + offset : 90 + offset] = first[50:90]
    check = RouteHealthCheck(moe_layers=MOE_LAYERS, engine="sglang")
    assert check.check(first, trajectory="req 1", token_ids=first_tokens) == ()
    with pytest.raises(
        RouteHealthError, match=r"rows \d+\.\.\d+ repeat, in every layer and in order, rows that req 1"
    ) as info:
        check.check(routes, trajectory="req 2", token_ids=tokens)
    (finding,) = info.value.findings
    assert finding.kind == "replayed_rows" and "sglang#36404" in finding.hint
    # Found where the copy holds a whole remembered block of req 1 (its aligned block of rows 64..79).
    assert finding.rows == (64 + offset, 79 + offset)
    assert check.stats.replayed_rows == 1 and check.stats.refused == 1


def test_real_routes_across_requests_pass_shared_prefixes_and_resends_included(router_model):
    rng = np.random.default_rng(30)
    system = rng.integers(3, 512, 64).tolist()  # one system prompt: a prefix-cached prompt replays its rows
    check = RouteHealthCheck(moe_layers=MOE_LAYERS)
    sent = []
    for i in range(12):
        tokens = system + rng.integers(3, 512, int(rng.integers(20, 80))).tolist()
        if i % 4 == 3:
            tokens = sent[-1]  # a resent (retried) request: its rows again, for the same tokens
        sent.append(tokens)
        assert check.check(real_routes(router_model, tokens), trajectory=f"req {i}", token_ids=tokens) == ()
    # A repeated token in another request, and Zipf-skewed draws, replay nothing either.
    for i in range(20):
        routes = router_routes(rng, 256, 4, 4, num_experts=64, dtype=np.int64, skew=1.4)
        assert check.check(routes, trajectory=f"zipf {i}", token_ids=rng.integers(0, 9, 256)) == ()
    assert check.stats.replayed_rows == 0 and check.stats.trajectories == 32


def test_the_replay_check_is_bounded_counted_and_can_be_turned_off(router_model):
    rng = np.random.default_rng(40)
    first_tokens = rng.integers(3, 512, 96).tolist()
    first = real_routes(router_model, first_tokens)
    tokens = rng.integers(3, 512, 96).tolist()
    replayed = real_routes(router_model, tokens)
    replayed[10:60] = first[10:60]
    off = RouteHealthCheck(moe_layers=MOE_LAYERS, remember_blocks=0)
    counted = RouteHealthCheck("count", moe_layers=MOE_LAYERS, remember_blocks=4)
    for check in (off, counted):
        check.check(first, trajectory="req 1", token_ids=first_tokens)
    assert off.check(replayed, trajectory="req 2", token_ids=tokens) == () and len(off.memory) == 0
    assert [f.kind for f in counted.check(replayed, trajectory="req 2", token_ids=tokens)] == ["replayed_rows"]
    assert counted.stats.replayed_rows == 1 and counted.stats.accepted_unhealthy == 1
    assert len(counted.memory) <= 4  # only the last remember_blocks blocks are kept
    copy = pickle.loads(pickle.dumps(counted))  # a client pickled into a worker: its memory starts empty
    assert len(copy.memory) == 0 and copy.stats.replayed_rows == 1 and copy.memory.max_blocks == 4
    counted.forget()
    assert counted.check(replayed, trajectory="req 2", token_ids=tokens) == ()
    with pytest.raises(ValueError, match="remember_blocks must be >= 0"):
        RouteHealthCheck(remember_blocks=-1)


def test_a_trace_refuses_a_stale_turn_and_stays_as_it_was(router_model):
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 512, 40).tolist()
    response = rng.integers(3, 512, 60).tolist()
    routes = real_routes(router_model, prompt + response)[:99]
    trace = RoutedExpertTrace(num_layers=LAYERS, topk=TOPK, moe_layers=MOE_LAYERS, name="sample 4")
    bad = routes.copy()
    bad[50:80] = bad[10]
    with pytest.raises(RouteHealthError, match="sample 4 turn 0: every layer: rows 50..79"):
        trace.record(prompt_len=40, generated_len=60, routes=bad, prompt_ids=prompt, response_ids=response)
    assert trace.turns == 0 and trace.prompt_start == 0
    trace.record(prompt_len=40, generated_len=60, routes=routes, prompt_ids=prompt, response_ids=response)
    assert trace.health.stats.trajectories == 2 and trace.health.stats.stale_rows == 1


def test_zero_routes_warning_is_a_route_health_warning():
    assert issubclass(ZeroRoutesWarning, RouteHealthWarning)
    check = RouteHealthCheck("warn", moe_layers=[0])
    with pytest.warns(ZeroRoutesWarning, match="layer 0"):
        check.check(np.zeros((3, 1, 2), np.uint8), trajectory="t")


def test_bad_arguments_are_refused_up_front():
    with pytest.raises(ValueError, match="on_unhealthy"):
        RouteHealthCheck("ignore")
    with pytest.raises(ValueError, match="4 entries for 3 route rows"):
        RouteHealthCheck().check(np.ones((3, 1, 1), np.uint8), trajectory="t", token_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="moe_layers holds 5"):
        RouteHealthCheck(moe_layers=[5]).check(np.ones((3, 2, 1), np.uint8), trajectory="t")
    with pytest.raises(TypeError, match="3-D integer"):
        RouteHealthCheck().check(np.ones((3, 2), np.uint8), trajectory="t")
    with pytest.raises(TypeError, match="health must be one of"):
        compact_routes(np.ones((1, 1, 1), np.int64), health=True)


def test_with_topk_equal_to_num_experts_identical_rows_say_nothing_and_are_counted():
    # Every row of a top-4-of-4 model is the one set {0, 1, 2, 3}: a layer "stuck" on it, or a run of
    # it, is what a healthy router returns, so the row-identity checks are skipped and counted.
    rng = np.random.default_rng(11)
    routes = np.tile(np.arange(4, dtype=np.uint8), (100, 3, 1))  # [100, 3, 4]
    tokens = rng.integers(0, 1000, 100)
    trace = RoutedExpertTrace(num_layers=3, topk=4, num_experts=4, name="s")
    trace.record(prompt_len=40, generated_len=61, routes=routes, prompt_ids=tokens[:40].tolist(),
                 response_ids=tokens[40:].tolist() + [7])  # fmt: skip  # main: refused (constant_layer, stale_rows)
    assert trace.health.stats.uninformative == 1
    assert compact_routes(routes, num_experts=4).shape == routes.shape
    check = RouteHealthCheck(num_experts=4)
    assert check.check(routes, trajectory="t", token_ids=tokens) == ()
    assert check.check(routes, trajectory="t again", token_ids=rng.integers(0, 1000, 100)) == ()
    assert (check.stats.uninformative, check.stats.refused, len(check.memory)) == (2, 0, 0)
    # Zero rows stay decidable there (with topk >= 2 a zero row repeats expert 0).
    zero = routes.copy()
    zero[:5] = 0
    with pytest.raises(RouteHealthError, match="rows 0..4 of 100 are all zero"):
        check.check(zero, trajectory="t", token_ids=tokens)
    # Without num_experts the check cannot know: one row throughout is refused, as documented.
    with pytest.raises(RouteHealthError, match="constant_layer"):
        check_route_health(routes, token_ids=tokens)


def test_two_experts_top1_skewed_router_is_undecidable_with_num_experts():
    # A top-1 router over 2 experts that prefers one of them: a layer sending every token to expert 1
    # (or to expert 0) and long runs of one full row are what it does; a row carries one bit.
    rng = np.random.default_rng(12)
    routes = (rng.random((200, 3, 1)) < 0.5).astype(np.uint8)
    routes[:, 1] = 1  # every token of layer 1 to expert 1
    routes[:, 2] = 0  # every token of layer 2 to expert 0
    routes[50:90, 0] = 0  # and a run of one full row in the other
    tokens = rng.integers(0, 1000, 200)
    trace = RoutedExpertTrace(num_layers=3, topk=1, num_experts=2, moe_layers=[0, 1, 2], name="s")
    trace.record(prompt_len=100, generated_len=101, routes=routes, prompt_ids=tokens[:100].tolist(),
                 response_ids=tokens[100:].tolist() + [7])  # fmt: skip  # main: refused
    assert trace.health.stats.uninformative == 1
    with pytest.raises(RouteHealthError) as info:
        check_route_health(routes, token_ids=tokens, moe_layers=[0, 1, 2])  # without num_experts: refused
    assert {f.kind for f in info.value.findings} == {"zero_rows", "constant_layer", "stale_rows"}
    check = RouteHealthCheck(moe_layers=[0, 1, 2], num_experts=2)
    assert check.check(routes, trajectory="t", token_ids=tokens) == ()
    assert check.stats.uninformative == 1
    # Three experts top-1 decide again (a layer of one expert over 200 tokens is a finding).
    assert [f.kind for f in check_route_health(routes, token_ids=tokens, num_experts=3, on_unhealthy="count")] == [
        "constant_layer",
        "stale_rows",
    ]


@pytest.mark.parametrize("shift", [0, 5])
def test_every_signature_is_caught_at_its_documented_threshold_and_not_below(router_model, shift):
    rng = np.random.default_rng(60 + shift)
    tokens = rng.integers(3, 512, 200 + shift).tolist()
    routes = real_routes(router_model, tokens)
    check = RouteHealthCheck("count", moe_layers=MOE_LAYERS)
    # A constant layer: 64 rows decide, 63 do not.
    for rows, found in [(64, 1), (63, 0)]:
        stuck = routes[:rows].copy()
        stuck[:, 2] = [1, 2, 3, 4]
        assert len(check.check(stuck, trajectory="c", token_ids=tokens[:rows])) == found
    # A stale run: 16 rows over 8 token changes decide; 15 rows, or 7 changes, do not.
    for length, changes, found in [(16, 8, 1), (15, 8, 0), (16, 7, 0)]:
        stale = routes.copy()
        stale[100 + shift : 100 + shift + length] = stale[10]
        ids = list(tokens)
        run = ids[100 + shift : 100 + shift + length]
        ids[100 + shift : 100 + shift + length] = [run[min(i, changes)] for i in range(length)]
        got = RouteHealthCheck("count", moe_layers=MOE_LAYERS).check(stale, trajectory="s", token_ids=ids)
        assert [f.kind for f in got] == ["stale_rows"] * found, (length, changes)
    # Replayed rows: a run of 31 rows holds an aligned 16-row block of the earlier response; 8 tokens must differ.
    first_tokens = rng.integers(3, 512, 200).tolist()
    first = real_routes(router_model, first_tokens)
    for length, differ, found in [(31, 8, 1), (15, 16, 0), (31, 7, 0)]:
        memory = RouteHealthCheck("count", moe_layers=MOE_LAYERS)
        assert memory.check(first, trajectory="req 1", token_ids=first_tokens) == ()
        copy = routes[:200].copy()
        a = 40 + shift
        copy[a : a + length] = first[a : a + length]
        ids = list(tokens[:200])
        ids[a : a + length] = first_tokens[a : a + length]
        for j in range(length):  # differ at `differ` positions of every aligned block inside the run
            if (a + j) % 16 < differ:
                ids[a + j] = first_tokens[a + j] + 1
        got = memory.check(copy, trajectory="req 2", token_ids=ids)
        assert [f.kind for f in got] == ["replayed_rows"] * found, (length, differ)
