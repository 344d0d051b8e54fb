"""Set-up checks run once when a `ReplayHook` is built: what replay can follow, and what not."""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from megatron.core import parallel_state

__all__ = ["InterleavedPipelineError", "check_config", "check_pipeline"]


class InterleavedPipelineError(ValueError):
    """The model uses the interleaved (virtual pipeline) schedule, which replay cannot follow.

    Megatron's interleaved 1F1B schedule runs the forwards of several model chunks
    before their backwards, in an order where one microbatch's forward feeds the
    routers of one chunk while recompute pops the routers of another. The
    per-router replay FIFOs then fall out of step and recompute silently replays
    another microbatch's routes.
    """


_VPP_ADVICE = (
    "Megatron's interleaved schedule runs several chunks' forwards before their "
    "backwards, so every router's replay FIFO receives microbatches in a different order "
    "than activation recompute pops them, and recompute silently replays another "
    "microbatch's routes. Build the model as one chunk per pipeline stage "
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


# CUDA-graph scopes that leave the router outside the graph; every other scope
# (an empty list = the whole layer, full_iteration, moe, moe_router,
# moe_preprocess) captures it.
_SCOPES_WITHOUT_ROUTER = {"attn", "mlp", "mamba"}


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
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        raise ValueError(
            "config.moe_router_load_balancing_type is 'sinkhorn': sinkhorn routing bypasses "
            "replay; use 'aux_loss', 'seq_aux_loss' or 'none'"
        )
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "config.overlap_moe_expert_parallel_comm=True: the overlapped schedule runs a "
            "microbatch's router forward after the hook has switched the routers to "
            "REPLAY_BACKWARD for recompute, so forwards would consume recompute's routes; "
            "set overlap_moe_expert_parallel_comm=False"
        )
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        scope = _scope_names(getattr(config, "cuda_graph_scope", None))
        if not scope or not set(scope) <= _SCOPES_WITHOUT_ROUTER:
            raise ValueError(
                f"config.cuda_graph_impl={impl!r} with cuda_graph_scope={scope} captures the "
                "router in a CUDA graph: the graph replays the top-k of the capture run and "
                "never consults the routes installed per microbatch; limit cuda_graph_scope "
                "to 'attn' (or 'mlp'/'mamba') or set cuda_graph_impl='none'"
            )
    factor = getattr(config, "moe_expert_capacity_factor", None)
    if factor is not None:
        warnings.warn(
            f"config.moe_expert_capacity_factor={factor}: experts drop tokens beyond their "
            "capacity, and which tokens are dropped depends on the whole microbatch (padding "
            "and other sequences included), so training drops different (token, expert) "
            "assignments than inference did even with every route replayed; watch "
            "ReplayStats.dropped_fraction, or set moe_expert_capacity_factor=None",
            UserWarning,
            stacklevel=3,
        )


def _scope_names(scope: Any) -> list[str]:
    if scope is None:
        return []
    items: Sequence[Any] = scope if isinstance(scope, (list, tuple)) else [scope]
    names = []
    for item in items:
        name = getattr(item, "name", item)
        names.extend(str(name).split(","))
    return [n for n in names if n and n != "full"]
