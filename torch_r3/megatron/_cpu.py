"""CPU redirections for megatron-core's CUDA-only code paths: the one module where they live.

For running Megatron on a CPU-only machine (the tests, the demo, the replay
benchmark); `ReplayHook` itself never applies them.

Exactly these spots of megatron-core (0.16 to 0.19), nothing else:

* `torch.zeros(..., device="cuda")` inside the pipeline schedules;
* `get_default_causal_mask` hard-coding `device="cuda"`;
* `TopKRouter.gating` moving its weights to `torch.cuda.current_device()`;
* checkpoint recompute reading and setting the CUDA RNG state;
* the RNG tracker states that `model_parallel_cuda_manual_seed` would create on
  the GPU (attention forks them even with dropout 0): dummy CPU states;
* `te_general_gemm` left undefined in `moe_utils` without Transformer Engine;
* 0.18+: `HybridStack` builds its final norm with Transformer Engine's `TENorm`
  whatever the spec says: Megatron's own `WrappedTorchNorm` instead;
* packed (THD) attention: the local `DotProductAttention` refuses
  `packed_seq_params` (`assert packed_seq_params is None`, "use
  TEDotProductAttention": Transformer Engine's kernel, CUDA only); here it runs
  once per packed sequence (`cu_seqlens_q_padded`), causal within each, so a
  packed batch attends as Transformer Engine's THD kernel does (context-parallel
  size 1).

Used by the in-process fixture (`tests/megatron/conftest.py`) and by the
spawned multi-process workers, which cannot use fixtures.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` keyword arguments of tensor factories to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.uint8)


def _ignore_rng_state(*args, **kwargs) -> None:
    return None


def _per_sequence_attention(original):
    """`DotProductAttention.forward` that runs a packed (THD) batch one sequence at a time."""

    def forward(self, query, key, value, attention_mask, *args, packed_seq_params=None, **kwargs):
        if packed_seq_params is None:
            return original(self, query, key, value, attention_mask, *args, **kwargs)
        bounds = packed_seq_params.cu_seqlens_q_padded
        if bounds is None:
            bounds = packed_seq_params.cu_seqlens_q
        # THD: [t, heads, head_dim] per tensor; each sequence runs as a batch of one, [s, 1, heads, head_dim].
        starts, ends = bounds[:-1].tolist(), bounds[1:].tolist()
        parts = [
            original(self, query[a:b, None], key[a:b, None], value[a:b, None], None, *args, **kwargs)[:, 0]
            for a, b in zip(starts, ends)
        ]
        return torch.cat(parts)

    forward.__wrapped__ = original  # type: ignore[attr-defined]  # functions take attributes
    return forward


def _patch_list():
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe import moe_utils

    patches = []
    try:  # megatron-core 0.18+ only
        from megatron.core.models.hybrid import hybrid_block
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        patches.append((hybrid_block, "TENorm", WrappedTorchNorm))
    except ImportError:
        pass
    return patches + [
        (transformer_utils, "get_default_causal_mask", _cpu_causal_mask),
        (fused_softmax, "get_default_causal_mask", _cpu_causal_mask),
        (torch.cuda, "current_device", lambda: "cpu"),
        (tp_random, "_get_cuda_rng_state", _cpu_rng_state),
        (tp_random, "_set_cuda_rng_state", _ignore_rng_state),
        (moe_utils, "te_general_gemm", None),
        (DotProductAttention, "forward", _per_sequence_attention(DotProductAttention.forward)),
    ], schedules


@contextlib.contextmanager
def megatron_on_cpu():
    """Apply the redirections for the duration of the block, then undo them."""
    patches, schedules = _patch_list()
    from megatron.core.tensor_parallel import random as tp_random

    saved = [(obj, name, getattr(obj, name, None), hasattr(obj, name)) for obj, name, _ in patches]
    originals = {}
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        # The schedules allocate their token counter with device="cuda"; run each
        # schedule function under the factory redirection.
        tracker = tp_random.get_cuda_rng_tracker()
        saved_states = tracker.get_states()
        tracker.set_states(
            {
                name: _cpu_rng_state()
                for name in (
                    tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                    tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                    tp_random._DATA_PARALLEL_RNG_TRACKER_NAME,
                )
            }
        )
        originals["tracker"] = (tracker, saved_states)
        for name in (
            "forward_backward_no_pipelining",
            "forward_backward_pipelining_without_interleaving",
            "forward_backward_pipelining_with_interleaving",
        ):
            original = getattr(schedules, name)
            originals[name] = original
            setattr(schedules, name, _under_cpu_mode(original))
        yield
    finally:
        tracker, saved_states = originals.pop("tracker", (None, None))
        if tracker is not None:
            tracker.set_states(saved_states)
        for name, original in originals.items():
            setattr(schedules, name, original)
        for obj, name, value, existed in saved:
            if existed:
                setattr(obj, name, value)
            else:
                delattr(obj, name)


def _under_cpu_mode(fn):
    def run(*args, **kwargs):
        with _CudaToCpu():
            return fn(*args, **kwargs)

    run.__wrapped__ = fn  # type: ignore[attr-defined]  # functions take attributes; mypy does not model it
    return run
