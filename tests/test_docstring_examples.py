"""The runnable examples in the core modules' docstrings are true."""

import doctest

import pytest

import torch_r3.collate
import torch_r3.cpu
import torch_r3.routes


@pytest.mark.parametrize("module", [torch_r3.routes, torch_r3.collate, torch_r3.cpu])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    if module is not torch_r3.cpu:  # cpu's results depend on the machine: no examples there
        assert result.attempted > 0
