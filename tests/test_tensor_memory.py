"""`torch_r3.bench.tensor_memory.TensorMemory` counts new storages, not views or in-place results, until freed."""

from __future__ import annotations

import torch

from torch_r3.bench.tensor_memory import TensorMemory


def test_new_storages_count_until_freed_and_views_and_in_place_results_do_not():
    meter = TensorMemory()
    x = torch.zeros(1000, dtype=torch.int16)  # made before counting: never counted
    with meter.counting():
        wide = x.to(torch.int64)  # 8000 bytes, kept
        view = wide[:10]  # shares wide's storage
        tmp = wide + 1  # 8000 bytes, freed below
        del tmp
        x.add_(1)  # in place on an uncounted storage
        x[:10].copy_(view)
    assert (meter.live, meter.peak, meter.allocated) == (8000, 16000, 16000)
    del wide
    assert meter.live == 8000  # the view keeps the storage
    del view
    assert meter.live == 0


def test_forward_hooks_count_only_what_runs_between_them():
    meter = TensorMemory()
    module = torch.nn.Identity()
    kept = []
    module.register_forward_hook(lambda m, args, out: kept.append(out.to(torch.float64)))  # 8 * 64 bytes
    handles = meter.count_forward_hooks([module])
    module(torch.zeros(64))  # the input and the module's own work are not counted
    assert (meter.live, meter.allocated) == (8 * 64, 8 * 64)
    for h in handles:
        h.remove()
    module(torch.zeros(64))
    assert meter.allocated == 8 * 64
