"""Fixtures for the Megatron tests: gloo world of one, CPU redirections, a tiny MoE GPT.

The CUDA-only spots of megatron-core are redirected to the CPU by
``torch_r3.megatron._cpu.megatron_on_cpu`` (see that module for the exact list).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core.transformer.moe.router_replay")

import torch
import torch.distributed as dist

from tests.megatron._models import build_model
from torch_r3.megatron._cpu import megatron_on_cpu


@pytest.fixture(scope="session")
def world_of_one():
    """A gloo process group of size 1 and Megatron's parallel state (TP=PP=CP=1)."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # An in-process store: no TCP port to lose to another process between probe and bind.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def cpu_megatron(world_of_one):
    """Megatron on the CPU for one test (redirections undone afterwards)."""
    with megatron_on_cpu():
        yield


@pytest.fixture
def make_model(cpu_megatron):
    """Factory for a tiny MoE GPTModel (see ``_models.build_model``)."""
    torch.manual_seed(0)
    return build_model
