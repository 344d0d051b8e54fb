"""Body of the multi-rank tests (spawned processes; one result file per rank).

Every scenario runs the same eight samples through the same model twice in the
same spawn: once in a single process with no parallelism (global rank 0, the
reference) and once over the parallel layout under test, each rank reading its
share through a ``DataLoader`` with ``DistributedSampler`` and ``R3Collator`` and
replaying with its own ``ReplayHook``. The parallel model loads the reference's
weights (sharded along each parameter's ``partition_dim``), so both compute the
same function.

Which (sample, position) each router row and each loss value belongs to is
worked out with Megatron's own helpers (``get_batch_on_this_cp_rank``, Transformer
Engine's THD partitioning, ``scatter_to_sequence_parallel_region``) applied to a
tensor of keys, independently of torch_r3's slicing; the test then compares row
by row with the reference.

Runs on the CPU with gloo (Megatron's CUDA-only calls redirected) or, for the
context-parallel scenarios, on GPUs with NCCL and Transformer Engine.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tests.megatron._models import EXPERTS, TOPK, VOCAB, RouteRecorder, make_config
from tests.samples import route_samples
from torch_r3 import Padded

NUM_SAMPLES = 8
SEQ = 16  # every sample fits; padded batches are always SEQ long
MBS = 2
LAYERS = 4
SAMPLER_SEED = 7
# Imported once by the process that forks the workers (see test_multirank._spawn).
PRELOAD = (
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "torch_r3.megatron",
    "torch_r3.megatron._cpu",
)


@dataclass(frozen=True)
class Scenario:
    """One parallel layout to check against the single-process reference."""

    name: str
    tp: int = 1
    pp: int = 1
    cp: int = 1
    packed: bool = False
    recompute: bool = False

    @property
    def needs_gpu(self) -> bool:
        # Megatron's local DotProductAttention asserts context_parallel_size == 1
        # and packed_seq_params is None: both need TEDotProductAttention.
        return self.cp > 1 or self.packed


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("dp2"),
        Scenario("tp2_sp", tp=2),
        Scenario("pp2_dp2_recompute", pp=2, recompute=True),
        Scenario("cp2_padded", cp=2),
        Scenario("cp2_thd", cp=2, packed=True),
    )
}


def make_samples(seed: int = 0) -> list[dict]:
    """Trajectories of 8, 12 or 16 tokens; the last token of each has no captured route.

    Lengths are multiples of 4 so that the packed layout splits evenly over two
    context-parallel ranks (2 * cp chunks per sequence).
    """
    rng = np.random.default_rng(seed)
    lengths = [4 * int(k) for k in rng.integers(2, 5, NUM_SAMPLES)]
    samples = route_samples(
        rng,
        lengths,
        captured="all_but_last",
        num_layers=LAYERS,
        topk=TOPK,
        num_experts=EXPERTS,
        token_ids=(2, VOCAB),
    )
    for i, sample in enumerate(samples):
        sample["input_ids"] = torch.tensor(sample["input_ids"])
        sample["sample_id"] = i
    return samples


def _collator(packed: bool):
    from torch_r3 import R3Collator

    if packed:
        return R3Collator(layout="packed", pad_token_id=0)
    return R3Collator(pad_token_id=0, layout=Padded(pad_to_multiple_of=SEQ))


def _loader(samples, packed: bool, dp_size: int, dp_rank: int):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(samples, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=SAMPLER_SEED)
    return DataLoader(samples, batch_size=MBS, sampler=sampler, collate_fn=_collator(packed))


def _build(scenario: Scenario, device: torch.device, te: bool):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    overrides = dict(
        num_layers=LAYERS,
        tensor_model_parallel_size=scenario.tp,
        pipeline_model_parallel_size=scenario.pp,
        context_parallel_size=scenario.cp,
        sequence_parallel=scenario.tp > 1,
        moe_router_load_balancing_type="none",
        calculate_per_token_loss=True,
        batch_p2p_comm=False,
    )
    if scenario.recompute:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if te:
        # Transformer Engine's fused and flash attention (the only ones with context
        # parallelism or THD) take 16-bit inputs only.
        overrides.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    config = make_config(**overrides)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te)
    if config.sequence_parallel and not te:
        _use_sequence_parallel_norm(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # Packed (THD) sequences restart their positions: rotary embeddings follow cu_seqlens.
        position_embedding_type="rope" if scenario.packed else "learned_absolute",
    )
    if te:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model.to(device)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` built from Megatron's norm arguments, usable with sequence parallelism.

    Without Apex or Transformer Engine, Megatron's local spec builds its norms with
    ``WrappedTorchNorm``, which asserts ``sequence_parallel`` is off (torch's norm
    does not tag its parameters for the tensor-parallel gradient all-reduce). This
    one tags them, as Apex's ``FusedLayerNorm`` does; nothing else differs.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def _use_sequence_parallel_norm(block_spec) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for layer in block_spec.layer_specs:
        for field in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(layer.submodules, field) is WrappedTorchNorm:
                setattr(layer.submodules, field, SequenceParallelLayerNorm)
    if block_spec.layer_norm is WrappedTorchNorm:
        block_spec.layer_norm = SequenceParallelLayerNorm


# ------------------------------------------------------------ one training step


class StepLog:
    """The forward step handed to Megatron's schedule, and what it saw per microbatch.

    For every microbatch: the router-row keys ``[N_local, 2]`` (sample id,
    position in that sample's row) in the order this rank's routers see their
    tokens, the per-token loss keys ``[n, 2]`` and the per-token losses ``[n]``
    (last pipeline stage only).
    """

    def __init__(self, scenario: Scenario, device: torch.device):
        self.scenario = scenario
        self.device = device
        self.row_keys: list[torch.Tensor] = []
        self.loss_keys: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []

    def forward_step(self, data_iterator, model):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        batch = next(data_iterator)
        fields, packed_seq_params = self._local_fields(batch)
        # Router rows are sequence-first (s * B + b); sequence parallelism then
        # keeps one contiguous share per tensor-parallel rank.
        keys = fields["keys"].transpose(0, 1).contiguous()  # [S, B, 2]
        if self.scenario.tp > 1:
            keys = scatter_to_sequence_parallel_region(keys, parallel_state.get_tensor_model_parallel_group())
        self.row_keys.append(keys.reshape(-1, 2).cpu())
        output = model(
            fields["tokens"], fields["positions"], None, labels=fields["labels"], packed_seq_params=packed_seq_params
        )
        keep, loss_keys = fields["keep"], fields["keys"]

        def loss_func(per_token):  # [B, S_local] cross entropy
            self.losses.append(per_token.detach()[keep].float().cpu())
            self.loss_keys.append(loss_keys[keep].cpu())
            loss = per_token.float()[keep].sum()
            return loss, keep.sum().to(torch.int), {"loss": loss.detach()}

        return output, loss_func

    def _local_fields(self, batch):
        """This rank's tokens, labels, positions and keys, cut by Megatron's own CP helpers."""
        ids = batch["input_ids"].to(self.device)
        sid = batch["sample_id"].to(self.device)
        if self.scenario.packed:
            cu = batch["cu_seqlens"].to(self.device, torch.int32)
            lengths = (cu[1:] - cu[:-1]).tolist()
            ids = ids[None]  # [1, N]
            positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])[None]
            owner = torch.repeat_interleave(sid, torch.tensor(lengths, device=self.device))[None]
            last = torch.zeros_like(ids, dtype=torch.bool)
            last[0, cu[1:] - 1] = True
            labels = torch.roll(ids, -1, dims=1)
            fields = dict(
                tokens=ids, labels=labels, positions=positions, keep=~last, keys=torch.stack([owner, positions], -1)
            )
            return _thd_on_this_cp_rank(fields, cu, max(lengths))
        b, s = ids.shape
        attention = batch["attention_mask"].to(self.device)
        columns = torch.arange(s, device=self.device).expand(b, s)
        # The loss is over predictions of real tokens: position t predicts t + 1.
        keep = torch.zeros_like(attention, dtype=torch.bool)
        keep[:, :-1] = attention[:, :-1].bool()
        fields = dict(
            tokens=ids,
            labels=torch.roll(ids, -1, dims=1),
            positions=columns,
            keep=keep,
            keys=torch.stack([sid[:, None].expand(b, s), columns], -1),
        )
        return _bshd_on_this_cp_rank(fields), None


def _bshd_on_this_cp_rank(fields: dict) -> dict:
    """Megatron's own per-sequence CP split, called the way the installed release wants it.

    0.18 added a required ``is_hybrid_cp`` argument, and without an explicit group
    its helper cuts the sequence across the whole world (DP ranks included).
    """
    import inspect

    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(fields, False, cp_group=group)
    return get_batch_on_this_cp_rank(fields, cp_group=group)


def _thd_on_this_cp_rank(fields: dict, cu: torch.Tensor, max_len: int):
    """Megatron's own per-document CP split of a packed batch, and its PackedSeqParams.

    0.16 has ``get_thd_batch_on_this_cp_rank``; 0.18 removed it, and its
    ``get_batch_on_this_cp_rank`` splits per document (through Transformer
    Engine's partitioned indices) only the keys tokens, labels, loss_mask and
    position_ids: the worker's own keys ride in those slots, two calls.
    """
    from megatron.core import utils

    if hasattr(utils, "get_thd_batch_on_this_cp_rank"):
        max_seqlen = torch.tensor([max_len], device=cu.device)
        return utils.get_thd_batch_on_this_cp_rank(fields, cu, cu, max_seqlen)
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    group = parallel_state.get_context_parallel_group()
    meta = dict(cu_seqlens=cu[None], cu_seqlens_padded=None, max_seqlen=None)
    first = utils.get_batch_on_this_cp_rank(
        dict(
            meta,
            tokens=fields["tokens"],
            labels=fields["labels"],
            position_ids=fields["positions"],
            loss_mask=fields["keep"],
        ),
        False,
        cp_group=group,
    )
    second = utils.get_batch_on_this_cp_rank(
        dict(meta, tokens=fields["keys"][..., 0], labels=fields["keys"][..., 1]), False, cp_group=group
    )
    local = dict(
        tokens=first["tokens"],
        labels=first["labels"],
        positions=first["position_ids"],
        keep=first["loss_mask"],
        keys=torch.stack([second["tokens"], second["labels"]], -1),
    )
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    return local, params


def run_step(scenario: Scenario, model, loader, device, *, reference: bool = False) -> dict:
    """One forward/backward with ``ReplayHook``; returns rows, maps, losses and grads."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from torch_r3.megatron import ReplayHook

    microbatches = list(loader)
    log = StepLog(scenario, device)
    recorder = RouteRecorder(model)
    model.zero_grad(set_to_none=True)
    with ReplayHook(model) as hook:
        hook.forward_backward(
            get_forward_backward_func(),
            forward_step_func=log.forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        layers = list(hook.layers)
        stats = hook.last_stats
    recorder.close()
    forward, recompute = {}, {}
    for layer, calls in recorder.calls.items():
        forward[layer] = [m.cpu() for a, m in calls if a != RouterReplayAction.REPLAY_BACKWARD]
        recompute[layer] = [m.cpu() for a, m in calls if a == RouterReplayAction.REPLAY_BACKWARD]
    return {
        "layers": layers,
        "sample_ids": [mb["sample_id"].tolist() for mb in microbatches],
        "row_keys": log.row_keys,
        "forward": forward,
        "recompute": recompute,
        "loss_keys": log.loss_keys,
        "losses": log.losses,
        "grads": _local_grads(model) if reference else _full_grads(model),
        "tokens": tuple(stats.tokens),
    }


# ----------------------------------------------------------- weights and grads


def _global_name(name: str, offset: int) -> str:
    """Local parameter name -> the single-process model's name (pipeline layer offset)."""
    match = re.search(r"decoder\.layers\.(\d+)\.", name)
    if match is None or offset == 0:
        return name
    return name[: match.start(1)] + str(int(match.group(1)) + offset) + name[match.end(1) :]


def _layer_offset(model) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config)


def _tp_split(param) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def load_reference_weights(model, full_state: dict) -> None:
    """Copy the reference's weights into a (sharded, staged) model."""
    from megatron.core import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    offset = _layer_offset(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = full_state[_global_name(name, offset)]
            if _tp_split(param):
                full = full.chunk(tp, dim=param.partition_dim)[rank]
            param.copy_(full)


def _local_grads(model) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu()
        for name, p in model.named_parameters()
    }


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over all data (as DDP's all-reduce would), unsharded.

    Tensor-parallel shards are gathered along ``partition_dim``; parameters that
    sequence parallelism leaves with partial gradients (norms, routers) are
    summed over the tensor-parallel group, as Megatron's ``finalize_model_grads``
    does; then everything is summed over the data- and context-parallel ranks.
    """
    from megatron.core import parallel_state

    offset = _layer_offset(model)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grad = grad.detach().clone()
        if tp > 1 and _tp_split(param):
            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad, group=tp_group)
            grad = torch.cat(parts, dim=param.partition_dim)
        elif tp > 1 and getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=tp_group)
        dist.all_reduce(grad, group=dp_cp_group)
        grads[_global_name(name, offset)] = grad.cpu()
    return grads


# ------------------------------------------------------------------- processes


@contextlib.contextmanager
def _on_device(device: torch.device):
    if device.type == "cuda":
        yield
    else:
        from torch_r3.megatron._cpu import megatron_on_cpu

        with megatron_on_cpu():
            yield


def run(rank: int, world_size: int, port: int, out_dir: str, names: list[str], backend: str = "gloo") -> None:
    """Spawned entry point: for each named scenario, the reference then the parallel run."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # several ranks share the cores; the models are tiny
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    from megatron.core import parallel_state

    samples = make_samples()
    with _on_device(device):
        for name in names:
            scenario = SCENARIOS[name]
            te = device.type == "cuda"
            # Reference: no parallelism. Every rank builds it (same seed, same
            # weights); rank 0 alone runs the step.
            parallel_state.initialize_model_parallel()
            torch.manual_seed(0)
            reference = _build(Scenario("reference", packed=scenario.packed), device, te)
            full_state = {k: v.detach().clone() for k, v in reference.named_parameters()}
            if rank == 0:
                loader = _loader(samples, scenario.packed, 1, 0)
                ref = run_step(scenario, reference, loader, device, reference=True)
                torch.save(ref, os.path.join(out_dir, f"{name}.reference.pt"))
            del reference
            parallel_state.destroy_model_parallel()

            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=scenario.tp,
                pipeline_model_parallel_size=scenario.pp,
                context_parallel_size=scenario.cp,
            )
            model = _build(scenario, device, te)
            load_reference_weights(model, full_state)
            loader = _loader(
                samples,
                scenario.packed,
                parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank(),
            )
            result = run_step(scenario, model, loader, device)
            result["ranks"] = {
                "dp": parallel_state.get_data_parallel_rank(),
                "tp": parallel_state.get_tensor_model_parallel_rank(),
                "pp": parallel_state.get_pipeline_model_parallel_rank(),
                "cp": parallel_state.get_context_parallel_rank(),
            }
            torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
            parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
