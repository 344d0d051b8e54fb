"""Set-up checks on configs built the normal way, on every supported megatron-core release."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from tests.megatron._models import make_config
from torch_r3.megatron import ReplayHook


def _graph_config(impl, modules):
    """A config with CUDA graphs set the way this release spells it (0.18 renamed the field)."""
    from megatron.core.transformer import enums

    field = "cuda_graph_modules" if hasattr(enums, "CudaGraphModule") else "cuda_graph_scope"
    try:
        return make_config(cuda_graph_impl=impl, **{field: modules})
    except AssertionError as err:
        pytest.skip(f"this megatron-core refuses cuda_graph_impl={impl!r}, {field}={modules}: {err}")


@pytest.mark.parametrize(
    "impl, modules, refused",
    [
        ("local", ["attn"], False),  # attention only: the router stays outside the graph
        ("transformer_engine", ["attn"], False),
        ("none", [], False),
        ("local", [], True),  # the whole layer
        ("local", ["moe_router"], True),
        ("transformer_engine", ["moe_router"], True),
        ("full_iteration", [], True),  # 0.18+: the whole iteration, router included
        ("local", ["full_iteration"], True),  # 0.16 spelling; 0.18+ migrates it to the impl above
    ],
)
def test_cuda_graph_settings_are_judged_by_whether_they_capture_the_router(make_model, impl, modules, refused):
    config = _graph_config(impl, modules)
    model = make_model()
    if refused:
        with pytest.raises(ValueError, match=r"cuda_graph_impl='[a-z_]+'.* captures the router"):
            ReplayHook(model, config)
    else:
        ReplayHook(model, config).close()


def test_rank_capacity_factor_warns_once_naming_the_setting(make_model):
    config = make_config()
    if not hasattr(config, "moe_expert_rank_capacity_factor"):
        pytest.skip("this megatron-core has no moe_expert_rank_capacity_factor (added in 0.19)")
    # Set after construction: the release accepts it only with a flex dispatcher backend
    # (hybridep / ncclep), which needs GPUs; the check reads the field either way.
    config = dataclasses.replace(config)
    object.__setattr__(config, "moe_expert_rank_capacity_factor", 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ReplayHook(make_model(), config).close()
    ours = [w for w in caught if "moe_expert_rank_capacity_factor" in str(w.message)]
    assert len(ours) == 1 and "drops tokens" in str(ours[0].message)


def test_unsupported_context_parallel_modes_are_refused_by_name(make_model):
    model = make_model()
    with pytest.raises(ValueError, match="packed_balancing='hybrid_cp': this context-parallel partitioning mode"):
        ReplayHook(model, packed_balancing="hybrid_cp")
    config = make_config()
    if not hasattr(config, "hybrid_context_parallel"):
        pytest.skip("this megatron-core has no hybrid_context_parallel (added in 0.18)")
    config = dataclasses.replace(config)
    object.__setattr__(config, "hybrid_context_parallel", True)  # needs max_seqlen_per_dp_cp_rank and GPUs
    with pytest.raises(ValueError, match="config.hybrid_context_parallel=True"):
        ReplayHook(model, config)
