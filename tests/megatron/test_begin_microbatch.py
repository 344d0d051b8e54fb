"""`ReplayHook.begin_microbatch` / `end_microbatch`: replay for a trainer whose forward step cannot be wrapped.

The reference is the same step through `wrap_forward_step` (`hook.forward_backward`): the same
logits, the same gradients, the same statistics, bit for bit; and the routes themselves.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron._models import RouteRecorder, expected_map, forward_step, make_batch, run_step
from torch_r3.megatron import ReplayHook


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_step_installed_per_microbatch_equals_the_wrapped_forward_step(make_model):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = make_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    batches = [make_batch(generator=torch.Generator().manual_seed(i)) for i in range(2)]
    hook = ReplayHook(model)
    model.zero_grad(set_to_none=True)
    run_step(hook, model, batches)
    wrapped, wrapped_stats = _grads(model), hook.last_stats

    def unwrapped_step(data_iterator, model):  # a trainer's own step: it installs the routes itself
        batch = next(data_iterator)
        hook.begin_microbatch(batch)
        output, loss = forward_step(iter((batch,)), model)
        hook.end_microbatch()
        return output, loss

    recorder = RouteRecorder(model)
    model.zero_grad(set_to_none=True)
    with hook.step(num_microbatches=2):
        get_forward_backward_func()(
            forward_step_func=unwrapped_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=2,
            seq_length=batches[0]["input_ids"].shape[1],
            micro_batch_size=batches[0]["input_ids"].shape[0],
        )
    recorder.close()
    ours = _grads(model)
    assert ours.keys() == wrapped.keys() and all(torch.equal(ours[k], v) for k, v in wrapped.items())
    assert hook.last_stats == wrapped_stats
    for layer, calls in recorder.calls.items():
        forwards = calls[::2] if len(calls) == 4 else calls  # each forward, then its recompute
        for (_, routing_map), batch in zip(forwards, batches):
            real = (~batch["router_padding_mask"]).transpose(0, 1).reshape(-1)
            want = expected_map(batch["rollout_expert_indices"][:, :, layer])
            assert torch.equal(routing_map[real], want[real])
    hook.close()


def test_begin_microbatch_outside_a_step_is_refused_and_end_is_idempotent(make_model):
    model = make_model()
    hook = ReplayHook(model)
    with pytest.raises(RuntimeError, match=r"begin_microbatch\(\) outside ReplayHook.step\(\)"):
        hook.begin_microbatch(make_batch())
    hook.end_microbatch()  # nothing open: nothing happens
    with hook.step(forward_only=True):
        hook.begin_microbatch(make_batch())
        hook.end_microbatch()
        hook.end_microbatch()
    hook.close()
