"""Set-up checks run once when a `ReplayHook` is built: what replay can follow, and what not."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron.core import parallel_state

from torch_r3._deprecation import warn_external

# `check_config` and `check_pipeline` are the hook's internals, shared with `hook.py` under plain names.
__all__ = ["InterleavedPipelineError"]


class InterleavedPipelineError(ValueError):
    """The model uses the interleaved (virtual pipeline) schedule, which this product refuses.

    The refusal is `torch_r3`'s contract, not a limit of Megatron. Megatron's
    interleaved 1F1B schedule runs the forwards of several model chunks before
    their backwards; a hook that installs every microbatch into every chunk's
    routers (what one data iterator per chunk hands it) leaves the per-router
    replay FIFOs out of step, and recompute silently replays another
    microbatch's routes.
    """


_VPP_ADVICE = (
    "ReplayHook does not support Megatron's interleaved schedule (torch_r3's choice): it runs "
    "several chunks' forwards before their backwards, and installing every microbatch into "
    "every chunk's routers leaves each router's replay FIFO out of step with activation "
    "recompute, which would silently replay another microbatch's routes. Build the model as "
    "one chunk per pipeline stage "
    "(virtual_pipeline_model_parallel_size=None or 1) and use the non-interleaved 1F1B "
    "schedule."
)


def check_pipeline(config: Any, num_chunks: int) -> None:
    """Refuse the interleaved (virtual pipeline) schedule, from the config, `parallel_state` or the chunks.

    Raises:
        InterleavedPipelineError: When the virtual pipeline size is above 1 or
            there is more than one model chunk.
    """
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None and vpp > 1:
        raise InterleavedPipelineError(
            f"config.virtual_pipeline_model_parallel_size={vpp}: router replay cannot run "
            f"under the interleaved pipeline schedule. {_VPP_ADVICE}"
        )
    if parallel_state.model_parallel_is_initialized():
        state_vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if state_vpp is not None and state_vpp > 1:
            raise InterleavedPipelineError(
                f"parallel_state virtual pipeline size is {state_vpp} (initialize_model_parallel"
                f"(virtual_pipeline_model_parallel_size=...)): router replay cannot run under "
                f"the interleaved pipeline schedule. {_VPP_ADVICE}"
            )
    if num_chunks > 1:
        raise InterleavedPipelineError(
            f"model: got {num_chunks} model chunks; more than one chunk per stage means the "
            f"interleaved pipeline schedule. {_VPP_ADVICE}"
        )


# CUDA-graph modules that leave the router outside the graph; every other choice
# (an empty list = the whole layer, full_iteration, moe, moe_router,
# moe_preprocess) captures it.
_MODULES_WITHOUT_ROUTER = {"attn", "mlp", "mamba"}

# Routing types that choose experts without asking RouterReplay (0.19 adds
# quantile_balancing). A deny-list cannot know the next one: the tripwire in
# routers.py catches any router call that skipped replay.
_BALANCING_WITHOUT_REPLAY = ("sinkhorn", "quantile_balancing")


def check_config(config: Any) -> None:
    """Refuse settings under which the routers bypass or break replay; warn about token dropping.

    Raises:
        ValueError: Naming the setting (see the Megatron guide's table).
    """
    if not getattr(config, "moe_enable_routing_replay", False):
        raise ValueError(
            "config.moe_enable_routing_replay is False: Megatron creates no RouterReplay "
            "instances; build the model with moe_enable_routing_replay=True"
        )
    if getattr(config, "moe_router_fusion", False):
        raise ValueError(
            "config.moe_router_fusion is True: Megatron's fused router bypasses replay; set moe_router_fusion=False"
        )
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    if balancing in _BALANCING_WITHOUT_REPLAY:
        raise ValueError(
            f"config.moe_router_load_balancing_type is {balancing!r}: {balancing} routing picks "
            "experts without consulting RouterReplay, so it bypasses replay; use 'aux_loss', "
            "'seq_aux_loss', 'global_aux_loss' or 'none'"
        )
    if getattr(config, "hybrid_context_parallel", False):
        raise ValueError(
            "config.hybrid_context_parallel=True: hybrid context parallelism picks a context-parallel "
            "group size per microbatch (local_cp_size), which the hook cannot know when it slices the "
            "routes; use a fixed context_parallel_size"
        )
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "config.overlap_moe_expert_parallel_comm=True: the overlapped schedule runs a "
            "microbatch's router forward after the hook has switched the routers to "
            "REPLAY_BACKWARD for recompute, so forwards would consume recompute's routes; "
            "set overlap_moe_expert_parallel_comm=False"
        )
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl != "none":
        # megatron-core 0.18 renamed cuda_graph_scope to cuda_graph_modules (and sets
        # the old field to None once migrated); read whichever this release has.
        field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
        modules = _module_names(getattr(config, field, None))
        if impl == "full_iteration" or not modules or not set(modules) <= _MODULES_WITHOUT_ROUTER:
            raise ValueError(
                f"config.cuda_graph_impl={impl!r} with {field}={modules} captures the router in a "
                "CUDA graph: the graph replays the top-k of the capture run and never consults the "
                f"routes installed per microbatch; limit {field} to 'attn' (or 'mlp'/'mamba') with "
                "cuda_graph_impl='local' or 'transformer_engine', or set cuda_graph_impl='none'"
            )
    factor = getattr(config, "moe_expert_capacity_factor", None)
    if factor is not None:
        warn_external(
            f"config.moe_expert_capacity_factor={factor}: experts drop tokens beyond their "
            "capacity, and which tokens are dropped depends on the whole microbatch (padding "
            "and other sequences included), so training drops different (token, expert) "
            "assignments than inference did even with every route replayed; watch "
            "ReplayStats.dropped_fraction, or set moe_expert_capacity_factor=None",
            UserWarning,
        )
    rank_factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    if rank_factor is not None:
        warn_external(
            f"config.moe_expert_rank_capacity_factor={rank_factor}: each expert-parallel rank drops "
            "tokens beyond its token budget, and which tokens are dropped depends on the whole "
            "microbatch, so training drops (token, expert) assignments that inference routed even "
            "with every route replayed; set moe_expert_rank_capacity_factor=None",
            UserWarning,
        )


def _module_names(scope: Any) -> list[str]:
    if scope is None:
        return []
    items: Sequence[Any] = scope if isinstance(scope, (list, tuple)) else [scope]
    names = []
    for item in items:
        name = getattr(item, "name", item)
        names.extend(str(name).split(","))
    return [n for n in names if n and n != "full"]
