"""The runnable examples in torch_r3.megatron's docstrings are true."""

import doctest

import pytest

pytest.importorskip("megatron.core.transformer.moe.router_replay")

import torch_r3.megatron.batch_checks


@pytest.mark.parametrize("module", [torch_r3.megatron.batch_checks])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
