"""SkyRL 0.4.0's own Megatron worker step, `MegatronModelWrapper`, with and without `install(worker=True)`.

The wrapper's `forward` (old log-probs) and `forward_backward_mini_batch`
(the training step) run unchanged on the suite's tiny Megatron model, on the
CPU, right-padded (`remove_microbatch_padding=False`). Its one CUDA call
(`_copy_tensor_dict_to_device(batch, torch.cuda.current_device())`,
`megatron_model_wrapper.py:441, 1076`) is the `torch.cuda.current_device`
redirection of `torch_r3.megatron._cpu`. SkyRL's default packed path
(`remove_microbatch_padding=True`) does not run on a CPU: on megatron-core
0.16.1 `preprocess_packed_seqs` fails building `PackedSeqParams(total_tokens=...)`
(`megatron_utils.py:802`, a field of 0.17+), and from there Megatron's local
attention refuses packed sequences (`dot_product_attention.py:153`, packed
attention is Transformer Engine's); its alignment is compared in
`test_skyrl_worker.py`.

References: SkyRL's own run of the same step (its logits where its replay is
right), and the routes themselves (`RouteRecorder`: the routing map each
router produced, against the captured routes placed token by token).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integrations.frameworks import load, load_skyrl_worker, requires, requires_skyrl_worker
from tests.samples import router_routes

pytestmark = [requires("skyrl"), requires_skyrl_worker(), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

pytest.importorskip("megatron.core.transformer.moe.router_replay")

from _models import EXPERTS, TOPK, RouteRecorder, expected_map

LAYERS = 2
VOCAB = 64


@pytest.fixture(scope="module")
def skyrl():
    wrapper, replay_utils, config = load_skyrl_worker(
        "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper",
        "skyrl.backends.skyrl_train.utils.replay_utils",
        "skyrl.train.config",
    )
    preprocess, training_batch = load(
        "skyrl", "skyrl.train.dataset.preprocess", "skyrl.backends.skyrl_train.training_batch"
    )
    return dict(wrapper=wrapper, replay_utils=replay_utils, config=config, preprocess=preprocess, batch=training_batch)


def tiny_model(monkeypatch):
    """The suite's tiny MoE GPTModel, its routers the only ones in Megatron's global RouterReplay list
    (SkyRL's own set-up writes every instance in that list; earlier tests' models would be in it)."""
    from _models import build_model
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    torch.manual_seed(0)
    model = build_model(seq_len=64)
    own = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    monkeypatch.setattr(RouterReplay, "global_router_replay_instances", own)
    return model


def mini_batch(skyrl, seed=0, n=4):
    """A SkyRL `TrainingInputBatch` as `convert_to_training_input` builds it (SkyRL's own collation)."""
    rng = np.random.default_rng(seed)
    prompts, responses, rewards, masks, routes = [], [], [], [], []
    for _ in range(n):
        p, r = int(rng.integers(2, 8)), int(rng.integers(3, 9))
        prompts.append(rng.integers(1, VOCAB, p).tolist())
        responses.append(rng.integers(1, VOCAB, r).tolist())
        rewards.append([0.0] * r)
        masks.append([1] * r)
        routes.append(router_routes(rng, p + r - 1, LAYERS, TOPK, num_experts=EXPERTS))  # the last token uncaptured
    pre = skyrl["preprocess"]
    out = pre.convert_prompts_responses_to_batch_tensors(0, prompts, responses, rewards, masks, None, routes)
    actions = out[0].shape[1] - max(len(p) for p in prompts)
    return skyrl["batch"].TrainingInputBatch(
        {
            "sequences": out[0],
            "attention_mask": out[1],
            "rollout_expert_indices": out[6],
            "router_padding_mask": pre.make_router_padding_mask(out[1], [len(r) for r in routes]),
        }
    ), actions


def micro_dicts(batch, actions, per):
    """The micro-batch dicts SkyRL's `MegatronPolicyWorker.forward_backward` builds for the wrapper."""
    dicts = []
    chunks = batch.chunk(per)
    for chunk in chunks:
        attention = chunk["attention_mask"]
        positions = attention.long().cumsum(-1) - 1
        positions.masked_fill_(attention == 0, 0)
        b = attention.shape[0]
        zeros = torch.zeros(b, actions)
        dicts.append(
            {
                "sequences": chunk["sequences"],
                "attention_mask": attention,
                "position_ids": positions,
                "num_actions": actions,
                "old_action_log_probs": zeros,
                "base_action_log_probs": zeros,
                "advantages": zeros,
                "loss_mask": torch.ones(b, actions),
                "rollout_action_logprobs": None,
                "response_mask": None,
                "rollout_expert_indices": chunk["rollout_expert_indices"],
                "router_padding_mask": chunk["router_padding_mask"],
                "sub_seq_lengths": None,
                "num_microbatches": len(chunks),
                "num_real_microbatches": len(chunks),
            }
        )
    return dicts


def wrapper_for(skyrl, model):
    cfg = skyrl["config"].TrainerConfig()
    cfg.remove_microbatch_padding = False  # the right-padded path: the one a CPU runs
    return skyrl["wrapper"].MegatronModelWrapper(cfg, [model])


def old_log_probs(wrapper, batch, actions, per):
    wrapper.eval()
    with torch.no_grad():
        return wrapper.forward(
            micro_dicts(batch, actions, per), seq_len=batch["sequences"].shape[1], micro_batch_size=per
        )


def training_step(wrapper, model, batch, actions, per):
    """SkyRL's `forward_backward_mini_batch` (cross-entropy loss); per-token log-probs and the gradients."""
    wrapper.train()
    model.zero_grad(set_to_none=True)
    metrics = wrapper.forward_backward_mini_batch(
        micro_dicts(batch, actions, per),
        seq_len=batch["sequences"].shape[1],
        micro_batch_size=per,
        loss_fn="cross_entropy",
    )
    logprobs = [o["logprobs"] for m in metrics for o in m["loss_fn_outputs"]]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs, grads


def captured_maps(batch, per):
    """Per micro-batch and layer, the routing map of the captured routes placed right-padded, and the captured rows."""
    from torch_r3.integrations.skyrl import microbatch

    out = []
    for chunk in batch.chunk(per):
        b = microbatch(chunk)
        captured = (~b["router_padding_mask"]).transpose(0, 1).reshape(-1)
        out.append(
            ({layer: expected_map(b["rollout_expert_indices"][:, :, layer]) for layer in range(LAYERS)}, captured)
        )
    return out


def test_the_wrapper_runs_unchanged_and_replays_bit_identically_where_skyrl_is_right(skyrl, cpu_megatron, monkeypatch):
    """One sequence per micro-batch: SkyRL's replay is right. Replaying its filler rows too
    (`uncaptured="replay"`), the installed hook gives the same log-probs and gradients, bit for bit."""
    import torch_r3.integrations.skyrl as r3_skyrl

    model = tiny_model(monkeypatch)
    wrapper = wrapper_for(skyrl, model)
    batch, actions = mini_batch(skyrl)
    theirs = old_log_probs(wrapper, batch, actions, 1)
    theirs_lp, theirs_grads = training_step(wrapper, model, batch, actions, 1)
    with r3_skyrl.install(worker=True, uncaptured="replay") as handle:
        ours = old_log_probs(wrapper, batch, actions, 1)
        assert handle.last_stats.microbatches == 4 and handle.last_stats.tokens.live == 0
        ours_lp, ours_grads = training_step(wrapper, model, batch, actions, 1)
    assert torch.equal(ours, theirs)
    assert ours_lp == theirs_lp
    assert theirs_grads.keys() == ours_grads.keys() and all(
        torch.equal(ours_grads[k], v) for k, v in theirs_grads.items()
    )


def test_a_training_step_through_the_wrapper_replays_every_captured_route_and_routes_the_rest_live(
    skyrl, cpu_megatron, monkeypatch
):
    import torch_r3.integrations.skyrl as r3_skyrl

    model = tiny_model(monkeypatch)
    wrapper = wrapper_for(skyrl, model)
    batch, actions = mini_batch(skyrl, seed=3)
    recorder = RouteRecorder(model)
    with r3_skyrl.install(worker=True) as handle:
        training_step(wrapper, model, batch, actions, 2)
        stats = handle.last_stats
    recorder.close()
    expected = captured_maps(batch, 2)
    assert stats.microbatches == 2 and stats.tokens.captured == sum(int(c.sum()) for _, c in expected)
    assert stats.live_fraction > 0  # each trajectory's last token (uncaptured) routed live
    for layer, calls in recorder.calls.items():
        assert len(calls) == 2
        for (_, routing_map), (maps, captured) in zip(calls, expected, strict=True):
            assert torch.equal(routing_map[captured], maps[layer][captured])


def test_skyrls_right_padded_two_sequence_micro_batch_replays_on_the_wrong_tokens_and_torch_r3s_does_not(
    skyrl, cpu_megatron, monkeypatch
):
    """SkyRL 0.4.0 writes a right-padded micro-batch's routes batch-first (`_split_replay_indices`:
    `[L, B * T, K]`); Megatron's routers read tokens sequence-first (`[T * B]`). With two sequences per
    micro-batch, token (t, b) replays the route at flat index t * B + b read batch-first. Installed, the
    hook writes them sequence-first: every captured route on its own token, and the log-probs those of
    one sequence per micro-batch, up to float rounding."""
    import torch_r3.integrations.skyrl as r3_skyrl

    model = tiny_model(monkeypatch)
    wrapper = wrapper_for(skyrl, model)
    batch, actions = mini_batch(skyrl, seed=5)
    expected = captured_maps(batch, 2)
    with r3_skyrl.install(worker=True, uncaptured="replay"):
        reference = old_log_probs(wrapper, batch, actions, 1)  # right: one sequence per micro-batch
    recorder = RouteRecorder(model)
    theirs = old_log_probs(wrapper, batch, actions, 2)
    skyrl_maps = {layer: [m for _, m in calls] for layer, calls in recorder.calls.items()}
    recorder.clear()
    with r3_skyrl.install(worker=True, uncaptured="replay"):
        ours = old_log_probs(wrapper, batch, actions, 2)
    recorder.close()
    from torch_r3.integrations.skyrl import microbatch

    for i, chunk in enumerate(batch.chunk(2)):
        routes = microbatch(chunk)["rollout_expert_indices"]  # [B, T, L, K], right-padded
        b, t = routes.shape[:2]
        maps, captured = expected[i]
        for layer in range(LAYERS):
            batch_first = torch.zeros(t * b, EXPERTS, dtype=torch.bool).scatter(
                1, routes[:, :, layer].long().reshape(b * t, -1), True
            )
            assert torch.equal(skyrl_maps[layer][i], batch_first)  # SkyRL: the named divergence
            assert not torch.equal(skyrl_maps[layer][i][captured], maps[layer][captured])
            assert torch.equal(recorder.calls[layer][i][1], maps[layer])  # torch_r3: sequence-first, exact
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert (theirs - reference).abs().max() > 1e-2


def test_uninstall_restores_skyrls_replay_everywhere_and_frees_the_routers(skyrl, cpu_megatron, monkeypatch):
    import torch_r3.integrations.skyrl as r3_skyrl
    from torch_r3.megatron import ReplayHook

    replay_utils, wrapper_module = skyrl["replay_utils"], skyrl["wrapper"]
    names = ("setup_per_microbatch_replay_forward", "setup_per_microbatch_replay_backward", "router_replay_schedule")
    originals = {n: getattr(replay_utils, n) for n in (*names, "patch_topk_router_layer_number")}
    lookup = wrapper_module.get_forward_backward_func
    model = tiny_model(monkeypatch)
    wrapper = wrapper_for(skyrl, model)
    batch, actions = mini_batch(skyrl, seed=2)
    handle = r3_skyrl.install(worker=True)
    for name in names:
        assert getattr(replay_utils, name) is not originals[name]
        assert getattr(wrapper_module, name) is getattr(replay_utils, name)  # imported by name there
    old_log_probs(wrapper, batch, actions, 2)
    assert len(handle.worker.hooks) == 1
    handle.uninstall()
    for name, original in originals.items():
        assert getattr(replay_utils, name) is original
    for name in names:
        assert getattr(wrapper_module, name) is originals[name]
    assert wrapper_module.get_forward_backward_func is lookup
    with ReplayHook(model):  # the installed hook released the routers
        pass
    assert old_log_probs(wrapper, batch, actions, 1).shape == (4, actions)  # SkyRL's own replay again


@pytest.mark.parametrize("align", [1, 4])
def test_the_installed_set_up_replays_skyrls_packed_layout_exactly(skyrl, cpu_megatron, monkeypatch, align):
    """SkyRL's default layout (`remove_microbatch_padding=True`), which the wrapper cannot run on a CPU:
    the installed functions are called as its forward-step closure calls them, with SkyRL's own
    `build_token_metadata_layout` (each sequence aligned to `align`), and the model runs the packed
    micro-batch as one `[1, N]` row (no THD attention here). Every captured route lands on its token."""
    import torch_r3.integrations.skyrl as r3_skyrl
    from torch_r3.integrations.skyrl import microbatch

    (metadata,) = load("skyrl", "skyrl.backends.skyrl_train.distributed.megatron.token_metadata")
    monkeypatch.setattr(metadata, "get_packed_seq_align_size", lambda *a, **k: align)
    model = tiny_model(monkeypatch)
    batch, _ = mini_batch(skyrl, seed=7)
    chunks = batch.chunk(2)
    replay_utils, wrapper_module = skyrl["replay_utils"], skyrl["wrapper"]
    recorder = RouteRecorder(model)
    with r3_skyrl.install(worker=True) as handle:

        def schedule(**kwargs):
            for chunk in chunks:
                attention = chunk["attention_mask"].bool()
                layout = metadata.build_token_metadata_layout(
                    attention, attention.device, packed=True, fp8_enabled=False
                )
                kwargs_for_model = wrapper_module.setup_per_microbatch_replay_forward(
                    chunk["rollout_expert_indices"],
                    chunk["router_padding_mask"],
                    attention,
                    model=model,
                    model_config=model.config,
                    metadata_layout=layout,
                    remove_microbatch_padding=True,
                )
                assert kwargs_for_model == {}
                n = int(layout.cu_seqlens_padded[-1])
                ids = torch.ones(1, n, dtype=torch.long)
                with torch.no_grad():
                    model(ids, torch.arange(n)[None], None)
                wrapper_module.setup_per_microbatch_replay_backward()

        # The installed schedule lookup around this schedule instead of Megatron's (which would run SkyRL's closure).
        with replay_utils.router_replay_schedule(True):
            handle.worker.get_forward_backward_func(lambda: schedule)()(
                model=[model], num_microbatches=2, forward_only=True
            )
        stats = handle.last_stats
    recorder.close()
    assert stats.microbatches == 2
    for i, chunk in enumerate(chunks):
        ours = microbatch(chunk, packed=True, pad_to_multiple_of=align)
        routes, mask = ours["rollout_expert_indices"][None], ours["router_padding_mask"][None]
        captured = (~mask).transpose(0, 1).reshape(-1)
        for layer, calls in recorder.calls.items():
            assert torch.equal(calls[i][1][captured], expected_map(routes[:, :, layer])[captured])
