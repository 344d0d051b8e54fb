"""verl 0.9.1's own Megatron engine step, with verl's replay and with `torch_r3.integrations.verl.install()`.

What runs is verl's `MegatronEngine.forward_backward_batch` and
`MegatronEngineWithLMHead.forward_step` (micro-batching, Megatron's schedule,
verl's THD packing `preprocess_thd_engine`, its model forward, log-probs and
loss post-processing, backward) on the suite's tiny Megatron MoE model. Two
things are set up by hand, because they need a GPU or a checkpoint:

* the engine object: `MegatronEngine.__init__`/`initialize()` build the model
  from a Hugging Face checkpoint through mbridge and an optimizer on the GPU;
  here its attributes are set to the tiny model, verl's own `McoreEngineConfig`
  (`router_replay.mode="R3"`, THD) and a model config naming an architecture;
* the lines that need CUDA: `megatron/core/transformer/dot_product_attention.py`
  `assert packed_seq_params is None` (packed attention is Transformer Engine's,
  CUDA only) runs, as every CUDA-only spot of Megatron here, under the CPU
  redirections (`torch_r3.megatron._cpu`: one local attention per packed
  sequence); verl's own replay moves its packed routes `.to(device_name)`
  (`utils/megatron/router_replay_utils.py:508`), `"cuda"` on a machine without
  an accelerator, so its run sets that name to `"cpu"`.

Needs verl installed with its dependencies (the guide's recipe; `make test`
builds `.venv-verl` with it): the engine module imports Ray, Peft and more.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from tests.integrations.frameworks import requires_full_verl

pytestmark = [requires_full_verl(), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

pytest.importorskip("megatron.core.transformer.moe.router_replay")

from _models import EXPERTS, TOPK, VOCAB, RouteRecorder, expected_map, make_config, own_choice

P, R, LAYERS = 6, 8, 2
PROMPTS, RESPONSES = [3, 6, 2, 5], [5, 2, 8, 4]


def megatron_classes():
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TopKRouter, MoEAlltoAllTokenDispatcher, TransformerConfig


def snapshot():
    """Megatron's classes as they are now (verl's `apply_router_replay_patch` rewrites them for good)."""
    classes = megatron_classes()
    init = classes[-1].__init__
    return [(cls, dict(cls.__dict__)) for cls in classes], (init, init.__dict__.get("__signature__"))


def restore(saved):
    namespaces, (init, signature) = saved
    for cls, namespace in namespaces:
        for name in set(cls.__dict__) - set(namespace):
            delattr(cls, name)
        for name, value in namespace.items():
            if name not in ("__dict__", "__weakref__", "__doc__") and cls.__dict__.get(name) is not value:
                setattr(cls, name, value)
    if signature is None:
        init.__dict__.pop("__signature__", None)
    else:
        init.__signature__ = signature


@pytest.fixture
def megatron_classes_restored():
    saved = snapshot()
    yield saved
    restore(saved)


def build_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    torch.manual_seed(0)  # the same weights on every build (CPU initialisation)
    config = make_config()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    # rotary positions: verl's packed forward passes no position ids
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope")


def verl_engine(model, mode="R3"):
    """verl's `MegatronEngineWithLMHead` over the tiny model (its `__init__` needs a checkpoint and a GPU)."""
    import transformers
    from verl.workers.config import McoreEngineConfig
    from verl.workers.config.actor import RouterReplayConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(router_replay=RouterReplayConfig(mode=mode), use_remove_padding=True)
    engine.model_config = types.SimpleNamespace(
        mtp=types.SimpleNamespace(enable=False, enable_train=False),
        hf_config=transformers.PretrainedConfig(architectures=["Qwen3MoeForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
    )
    engine.tf_config = model.config
    engine.module = [model]
    engine.enable_routing_replay = engine.engine_config.router_replay.mode != "disabled"  # as __init__ sets it
    engine.mini_layer_topk_idx_list = []
    return engine


def rollout_routes(seed, *, fewer):
    """What the rollout captured per sample: n - 1 rows, or fewer (a multi-turn rollout), distinct experts."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        rows = p + r - 1 - (2 * (i % 2) + 1 if fewer else 0)
        out.append(np.stack([[rng.permutation(EXPERTS)[:TOPK] for _ in range(LAYERS)] for _ in range(rows)]))
    return out


def engine_batch(routes, seed=0):
    """The batch verl's trainer hands the actor: the agent loop's padded form through verl's `left_right_2_no_padding`."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    b = len(PROMPTS)
    g = torch.Generator().manual_seed(seed)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R, dtype=torch.long)
    routed = torch.zeros(b, P + R, LAYERS, TOPK, dtype=torch.int16)  # verl's agent loop: zeros, rows from P - p
    for i, (p, r, rows) in enumerate(zip(PROMPTS, RESPONSES, routes)):
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
        routed[i, P - p : P - p + len(rows)] = torch.from_numpy(rows).to(torch.int16)
    ids = torch.randint(1, VOCAB, (b, P + R), generator=g) * attention
    data = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response_mask,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "prompts": ids[:, :P],
            "responses": ids[:, P:],
            "routed_experts": routed,
        },
        batch_size=[b],
    )
    data = left_right_2_no_padding(data)
    data["temperature"] = torch.ones(b)
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, enable_routing_replay=True)
    return data


def loss_function(model_output, data, dp_group=None):
    return -model_output["log_probs"].values().sum() * 1e-3, {}


def run_step(engine, routes, recorder):
    recorder.clear()
    out = engine.forward_backward_batch(engine_batch(routes), loss_function, forward_only=False)
    log_probs = torch.cat([t for t in out["model_output"]["log_probs"].unbind()])
    return log_probs


def per_token(recorder, layer):
    """Each router call's [N, E] map and input, concatenated over the step's two micro-batches (packed order)."""
    maps = torch.cat([m for _, m in recorder.calls[layer]])
    inputs = torch.cat(recorder.inputs[layer])
    return maps, inputs


def captured_rows(routes):
    """Per packed token (sample after sample): whether it has a captured route, and the route."""
    captured, rows = [], []
    for p, r, x in zip(PROMPTS, RESPONSES, routes):
        n = p + r
        captured.append(torch.arange(n) < len(x))
        full = np.zeros((n, LAYERS, TOPK), dtype=np.int64)
        full[: len(x)] = x
        rows.append(torch.from_numpy(full))
    return torch.cat(captured), torch.cat(rows)


@pytest.mark.parametrize("fewer", [False, True], ids=["n-1 rows", "multi-turn, fewer rows"])
def test_verls_engine_step_replays_through_replay_hook(cpu_megatron, megatron_classes_restored, monkeypatch, fewer):
    from verl.utils.megatron import router_replay_utils
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    import torch_r3.integrations.verl as r3_verl

    routes = rollout_routes(3 + fewer, fewer=fewer)
    captured, rows = captured_rows(routes)
    last = torch.cat([torch.arange(p + r) == p + r - 1 for p, r in zip(PROMPTS, RESPONSES)])

    # verl's own replay: its patch on Megatron's router, its alignment, mask and THD packing. It moves the
    # packed routes to `device_name` (router_replay_utils.py:508), "cuda" wherever no accelerator is found.
    monkeypatch.setattr(router_replay_utils, "device_name", "cpu")
    apply_router_replay_patch()
    model = build_model()
    recorder = RouteRecorder(model)
    theirs = run_step(verl_engine(model), routes, recorder)
    their_maps = {layer: per_token(recorder, layer)[0] for layer in recorder.calls}
    recorder.close()
    restore(megatron_classes_restored)  # Megatron's own router again, for the second run

    with r3_verl.install(agent_loop=False) as installed:
        model = build_model()
        recorder = RouteRecorder(model)
        ours = run_step(verl_engine(model), routes, recorder)
        stats = installed.last_stats
        for layer in recorder.calls:
            maps, inputs = per_token(recorder, layer)
            # Replay exact: every captured row routes to the rollout's experts.
            assert torch.equal(maps[captured], expected_map(rows[captured][None, :, layer]))
            # Rows without a route (each sequence's last; verl's zero rows) route live: the router's own top-k.
            live = own_choice(recorder.routers[layer], inputs[~captured])
            assert torch.equal(maps[~captured], live)
            assert bool((maps.sum(1) == TOPK).all())
            theirs_layer = their_maps[layer]
            assert torch.equal(theirs_layer[captured], maps[captured])  # verl replays the captured rows the same
            zero_rows = ~captured & ~last
            if fewer:
                # verl's named divergence: its zero rows are replayed as expert 0, K times (one expert, not K).
                assert bool(zero_rows.any())
                assert bool((theirs_layer[zero_rows].sum(1) == 1).all()) and bool(theirs_layer[zero_rows][:, 0].all())
            else:
                assert not bool(zero_rows.any())
        recorder.close()
    assert stats is not None and stats.microbatches == 2
    assert stats.tokens.live == int((~captured).sum())
    if not fewer:  # where verl is right (n - 1 rows each), the step's log-probs are the same, bit for bit
        assert torch.equal(ours, theirs)
    else:
        assert not torch.equal(ours, theirs)


def test_uninstall_restores_verls_names_bound_before_and_after_install():
    from verl.utils.megatron import router_replay_patch
    from verl.workers.engine.megatron import transformer_impl
    from verl.workers.utils import padding

    import torch_r3.integrations.verl as r3_verl

    originals = {
        "apply_router_replay_patch": router_replay_patch.apply_router_replay_patch,
        "left_right_2_no_padding": padding.left_right_2_no_padding,
        "get_forward_backward_func": transformer_impl.get_forward_backward_func,
        "RouterReplayHelper": transformer_impl.RouterReplayHelper,
        "forward_backward_batch": transformer_impl.MegatronEngine.__dict__["forward_backward_batch"],
    }
    before = types.ModuleType("verl_user_before")  # a user module that imported verl's names first
    exec("from verl.workers.utils.padding import left_right_2_no_padding as to_nested", before.__dict__)
    sys.modules[before.__name__] = before
    try:
        installed = r3_verl.install()
        after = types.ModuleType("verl_user_after")  # one that imports them while torch_r3 is installed
        exec("from verl.utils.megatron.router_replay_patch import apply_router_replay_patch", after.__dict__)
        sys.modules[after.__name__] = after
        assert transformer_impl.apply_router_replay_patch is not originals["apply_router_replay_patch"]
        assert before.to_nested is not originals["left_right_2_no_padding"]
        assert after.apply_router_replay_patch is router_replay_patch.apply_router_replay_patch
        with pytest.raises(RuntimeError, match="already installed"):
            r3_verl.install()
        installed.uninstall()
        installed.uninstall()  # a second call does nothing
        assert router_replay_patch.apply_router_replay_patch is originals["apply_router_replay_patch"]
        assert transformer_impl.apply_router_replay_patch is originals["apply_router_replay_patch"]
        assert after.apply_router_replay_patch is originals["apply_router_replay_patch"]
        assert padding.left_right_2_no_padding is originals["left_right_2_no_padding"]
        assert before.to_nested is originals["left_right_2_no_padding"]
        assert transformer_impl.get_forward_backward_func is originals["get_forward_backward_func"]
        assert transformer_impl.RouterReplayHelper is originals["RouterReplayHelper"]
        assert transformer_impl.MegatronEngine.__dict__["forward_backward_batch"] is originals["forward_backward_batch"]
        r3_verl.install().uninstall()  # installable again
    finally:
        sys.modules.pop("verl_user_before", None)
        sys.modules.pop("verl_user_after", None)


@pytest.mark.parametrize("error", [AttributeError, KeyboardInterrupt])
def test_an_install_refused_half_way_leaves_every_module_as_it_was(error):
    """Defect (issue 43.6): one loaded module refused the assignment (a read-only module object, or any
    exception, KeyboardInterrupt included); what was swapped before it kept torch_r3's functions."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.megatron import router_replay_patch
    from verl.workers.engine.megatron import transformer_impl
    from verl.workers.utils import padding

    import torch_r3.integrations.verl as r3_verl

    originals = {
        "apply_router_replay_patch": router_replay_patch.apply_router_replay_patch,
        "left_right_2_no_padding": padding.left_right_2_no_padding,
        "_agent_loop_postprocess": AgentLoopWorker.__dict__["_agent_loop_postprocess"],
    }

    class Frozen(types.ModuleType):
        def __setattr__(self, name, value):
            raise error(f"{self.__name__} is read-only")

    frozen = Frozen("verl_user_frozen")  # bound verl's patch at its import, then was frozen
    frozen.__dict__["patch"] = originals["apply_router_replay_patch"]
    sys.modules[frozen.__name__] = frozen
    try:
        with pytest.raises(error, match="read-only"):
            r3_verl.install()
        assert padding.left_right_2_no_padding is originals["left_right_2_no_padding"]
        assert AgentLoopWorker.__dict__["_agent_loop_postprocess"] is originals["_agent_loop_postprocess"]
        assert router_replay_patch.apply_router_replay_patch is originals["apply_router_replay_patch"]
        assert transformer_impl.apply_router_replay_patch is originals["apply_router_replay_patch"]
        assert frozen.patch is originals["apply_router_replay_patch"]
        assert not hasattr(padding, "_torch_r3_installed") and not hasattr(transformer_impl, "_torch_r3_installed")
    finally:
        sys.modules.pop(frozen.__name__, None)
    r3_verl.install().uninstall()  # nothing was left installed: a later install() is not refused


def test_install_after_verls_router_patch_is_refused(megatron_classes_restored):
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    import torch_r3.integrations.verl as r3_verl

    apply_router_replay_patch()
    with pytest.raises(RuntimeError, match="before the Megatron engine is built"):
        r3_verl.install(agent_loop=False)
    r3_verl.install(agent_loop=True, engine=False).uninstall()  # nothing half-installed is left behind


def test_r2_mode_is_refused_under_install(cpu_megatron):
    import torch_r3.integrations.verl as r3_verl

    with r3_verl.install(agent_loop=False):
        engine = verl_engine(build_model(), mode="R2")
        with pytest.raises(NotImplementedError, match="router_replay.mode='R2'.*R2 recording is not replaced"):
            engine.forward_backward_batch(engine_batch(rollout_routes(1, fewer=False)), loss_function)
