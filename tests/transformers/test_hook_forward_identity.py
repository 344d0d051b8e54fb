"""The transformers hook replays a batch only in the forwards it belongs to.

Two ways a forward could take another batch's routes: Hugging Face's own activation (gradient)
checkpointing recomputes, in backward, a forward that ran outside `replay()` while a
`replay()` block is open (the recompute must route as its original forward did: live);
and a forward of another shape with the same number of tokens (`[3, 4]` under a replay
of a `[2, 6]` batch), which only a token count cannot tell apart.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.transformers.hf_models import build, inputs, make_batch
from torch_r3.transformers import ReplayHook


def _loss(logits, batch):
    return logits[batch["attention_mask"].bool()].logsumexp(-1).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_forward_outside_replay_recomputed_inside_an_open_block_routes_as_it_first_did(reentrant):
    model = build("qwen3_moe").train()
    ref = copy.deepcopy(model)  # no checkpointing, no hook: the forward as it ran
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    with ReplayHook(model) as hook:
        plain, replayed = make_batch(hook, seed=1), make_batch(hook, seed=2)  # the same [B, T]
        loss = _loss(model(**inputs(plain)).logits, plain)  # routed live, checkpointed
        with hook.replay(replayed):
            model(**inputs(replayed))
            loss.backward()  # recomputes the plain forward's layers while the block is open
    _loss(ref(**inputs(plain)).logits, plain).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_forward_of_another_shape_with_as_many_tokens_is_refused():
    model = build("qwen3_moe")
    with ReplayHook(model) as hook:
        batch = make_batch(hook)  # lengths (6, 4): [2, 6]
        assert tuple(batch["input_ids"].shape) == (2, 6)
        ids = torch.randint(3, 64, (3, 4))
        with torch.no_grad(), hook.replay(batch), pytest.raises(ValueError) as e:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        message = str(e.value)
        assert "[3, 4]" in message and "[2, 6]" in message, message
        with torch.no_grad(), hook.replay(batch):  # the batch's own shape still replays
            model(**inputs(batch))
