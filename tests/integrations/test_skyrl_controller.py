"""`torch_r3.integrations.skyrl` on the controller, against SkyRL 0.4.0's own code on the same inputs.

SkyRL's modules are loaded from the installed wheel behind bare parent packages
(`frameworks.load`: `skyrl.train`'s `__init__` imports `datasets`); everything
compared here is SkyRL's own function.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tests.integrations.frameworks import SKYRL_VERSION, installed_version, load, requires
from tests.samples import router_routes
from torch_r3 import BufferPool, Memory, Padded

pytestmark = requires("skyrl")

LAYERS, TOPK, EXPERTS = 3, 4, 64


@pytest.fixture(scope="module")
def skyrl():
    preprocess, training_batch, packed = load(
        "skyrl",
        "skyrl.train.dataset.preprocess",
        "skyrl.backends.skyrl_train.training_batch",
        "skyrl.backends.skyrl_train.utils.packed_tensor",
    )
    from torch_r3.integrations import skyrl as integration

    return preprocess, training_batch, packed, integration


def test_the_installed_skyrl_is_the_tested_release():
    assert installed_version("skyrl") == SKYRL_VERSION


def rollouts(seed: int, n: int = 7, *, dtypes=(np.uint8,), short: int = 1):
    """`n` trajectories as SkyRL's generator returns them: prompt/response ids, rewards, masks, routes.

    Each trajectory's routes cover its tokens but the last `short` or more (the
    last sampled token, multi-turn observations that no later turn evaluated).
    """
    rng = np.random.default_rng(seed)
    prompts, responses, rewards, masks, routes = [], [], [], [], []
    for i in range(n):
        p, r = int(rng.integers(1, 12)), int(rng.integers(1, 15))
        prompts.append(rng.integers(3, 500, p).tolist())
        responses.append(rng.integers(3, 500, r).tolist())
        rewards.append([0.0] * (r - 1) + [float(rng.random())])
        masks.append(rng.integers(0, 2, r).tolist())
        rows = max(1, p + r - short - int(rng.integers(0, 3)))
        dtype = dtypes[i % len(dtypes)]
        routes.append(router_routes(rng, rows, LAYERS, TOPK, num_experts=EXPERTS, dtype=dtype))
    return prompts, responses, rewards, masks, routes


def convert(preprocess, prompts, responses, rewards, masks, routes):
    return preprocess.convert_prompts_responses_to_batch_tensors(0, prompts, responses, rewards, masks, None, routes)


def assert_identical(ours, theirs):
    assert type(ours) is type(theirs)
    if ours is None:
        return
    if hasattr(ours, "cu_seqlens"):
        assert ours.values.dtype == theirs.values.dtype and ours.cu_seqlens.dtype == theirs.cu_seqlens.dtype
        assert torch.equal(ours.values, theirs.values) and torch.equal(ours.cu_seqlens, theirs.cu_seqlens)
    else:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("dtypes", [(np.uint8,), (np.int16,), (np.uint8, np.int16), (np.int32, np.uint8)], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_installed_collation_makes_skyrls_batch_bit_for_bit(skyrl, dtypes, seed):
    preprocess, _, packed, integration = skyrl
    data = rollouts(seed, dtypes=dtypes)
    theirs = convert(preprocess, *data)
    with integration.install() as handle:
        assert preprocess._collate_rollout_expert_indices is not handle  # swapped in SkyRL's module
        ours = convert(preprocess, *data)
    assert len(ours) == len(theirs) == 8
    for a, b in zip(ours, theirs):
        assert_identical(a, b)
    assert isinstance(ours[6], packed.PackedTensor)


def test_install_replaces_the_module_attribute_and_uninstall_restores_it(skyrl):
    preprocess, _, _, integration = skyrl
    original = preprocess._collate_rollout_expert_indices
    original_mask = preprocess.make_router_padding_mask
    handle = integration.install()
    try:
        assert preprocess._collate_rollout_expert_indices is not original
        assert preprocess.make_router_padding_mask is integration.make_router_padding_mask
        with pytest.raises(RuntimeError, match="already installed"):
            integration.install()
    finally:
        handle.uninstall()
    handle.uninstall()  # a second call does nothing
    assert preprocess._collate_rollout_expert_indices is original
    assert preprocess.make_router_padding_mask is original_mask
    assert not hasattr(preprocess, "_torch_r3_installed")


def test_the_router_padding_mask_equals_skyrls(skyrl):
    preprocess, _, _, integration = skyrl
    prompts, responses, rewards, masks, routes = rollouts(3, n=9, short=2)
    attention = convert(preprocess, prompts, responses, rewards, masks, routes)[1]
    captured = [len(r) for r in routes]
    theirs = preprocess.make_router_padding_mask(attention, captured)
    ours = integration.make_router_padding_mask(attention, captured)
    assert ours.dtype == theirs.dtype == torch.bool and torch.equal(ours, theirs)
    # The same mask as torch_r3's own left-padded batch of these routes.
    from torch_r3 import collate_routes

    batch = collate_routes(routes, attention.sum(1).tolist(), layout=Padded(seq_len=attention.shape[1]))
    assert torch.equal(ours, batch["router_padding_mask"])


def test_a_right_padded_attention_mask_is_refused_where_skyrls_mask_is_silently_wrong(skyrl):
    preprocess, _, _, integration = skyrl
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    wrong = preprocess.make_router_padding_mask(right, [2, 3])
    assert wrong[0].tolist() == [True, False, False, True]  # SkyRL marks the left-padded positions
    with pytest.raises(ValueError, match=r"attention_mask\[0\]: expected a left-padded row"):
        integration.make_router_padding_mask(right, [2, 3])


def test_bad_routes_are_refused_naming_the_sample(skyrl):
    _, _, _, integration = skyrl
    good = np.zeros((2, LAYERS, TOPK), np.uint8)
    with pytest.raises(ValueError, match=r"routes\[1\]: expected a canonical dtype"):
        integration.collate_rollout_expert_indices([good, good.astype(np.int64)], np.array([3, 3]))
    with pytest.raises(ValueError, match=r"routes\[0\]: 2 route rows for 1 tokens"):
        integration.collate_rollout_expert_indices([good], np.array([1]))
    with pytest.raises(ValueError, match=r"routes\[1\]: expected \[rows, 3, 4\]"):
        integration.collate_rollout_expert_indices([good, np.zeros((2, LAYERS, 2), np.uint8)], np.array([2, 2]))


def test_a_pooled_batch_survives_training_input_batch_pickling_and_chunk(skyrl):
    preprocess, training_batch, _, integration = skyrl
    prompts, responses, rewards, masks, routes = rollouts(5, n=8)
    reference = convert(preprocess, prompts, responses, rewards, masks, routes)
    pool = BufferPool()
    with integration.install(memory=Memory(buffers=pool)):
        first = convert(preprocess, prompts, responses, rewards, masks, routes)
        assert_identical(first[6], reference[6])
        misses = pool.stats()["misses"]
        del first  # SkyRL dropped the step's batch: its buffers go back to the pool
        again = convert(preprocess, prompts, responses, rewards, masks, routes)
    assert pool.stats()["misses"] == misses  # the next step's batch is all recycled memory

    def batch(tensors):
        attention = tensors[1]
        return training_batch.TrainingInputBatch(
            {
                "sequences": tensors[0],
                "attention_mask": attention,
                "rollout_expert_indices": tensors[6],
                "router_padding_mask": preprocess.make_router_padding_mask(attention, [len(r) for r in routes]),
            }
        )

    theirs_batch, ours_batch = batch(reference), batch(again)
    restored = pickle.loads(pickle.dumps(ours_batch, protocol=5))
    for chunk_ours, chunk_theirs in zip(restored.chunk(3), theirs_batch.chunk(3), strict=True):
        assert_identical(chunk_ours["rollout_expert_indices"], chunk_theirs["rollout_expert_indices"])
        assert_identical(chunk_ours["router_padding_mask"], chunk_theirs["router_padding_mask"])


def test_install_also_replaces_the_name_the_trainer_module_imported(skyrl, monkeypatch):
    """`skyrl.train.trainer` binds `make_router_padding_mask` at import. It imports Ray and cannot be
    loaded here, so a module object holding that one binding stands in for it in `sys.modules`."""
    import sys
    import types

    preprocess, _, _, integration = skyrl
    trainer = types.ModuleType("skyrl.train.trainer")
    trainer.make_router_padding_mask = preprocess.make_router_padding_mask
    monkeypatch.setitem(sys.modules, "skyrl.train.trainer", trainer)
    with integration.install():
        assert trainer.make_router_padding_mask is integration.make_router_padding_mask
    assert trainer.make_router_padding_mask is preprocess.make_router_padding_mask


def test_a_trajectory_without_captured_rows_is_collated_where_skyrl_refuses_it(skyrl):
    """The one named difference: an empty route array becomes an all-filler segment."""
    preprocess, _, _, integration = skyrl
    routes = [
        np.zeros((0, LAYERS, TOPK), np.uint8),
        np.ones((2, LAYERS, TOPK), np.uint8) * np.arange(TOPK, dtype=np.uint8),
    ]
    with pytest.raises(ValueError, match="must contain routes for every trajectory"):
        preprocess._collate_rollout_expert_indices(routes, np.array([3, 2]))
    packed = integration.collate_rollout_expert_indices(routes, np.array([3, 2]))
    assert packed.cu_seqlens.tolist() == [0, 3, 5]
    assert torch.equal(packed.segment(0), torch.arange(TOPK, dtype=torch.uint8).expand(3, LAYERS, TOPK))


def test_a_module_that_imports_the_mask_after_install_gets_skyrls_back_at_uninstall(skyrl, tmp_path, monkeypatch):
    """Defect: `skyrl.train.trainer` imported after `install()` bound torch_r3's function and kept it.
    A real module file, imported while installed, binds the name as the trainer does."""
    preprocess, _, _, integration = skyrl
    original = preprocess.make_router_padding_mask
    (tmp_path / "late_trainer_r3.py").write_text(
        "from skyrl.train.dataset.preprocess import make_router_padding_mask\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "late_trainer_r3", raising=False)
    handle = integration.install()
    try:
        import late_trainer_r3

        assert late_trainer_r3.make_router_padding_mask is integration.make_router_padding_mask
    finally:
        handle.uninstall()
    assert late_trainer_r3.make_router_padding_mask is original
    assert integration.make_router_padding_mask is not original  # torch_r3's own name stays torch_r3's


def test_install_on_a_skyrl_without_the_collation_function_refuses_and_swaps_nothing(skyrl, monkeypatch):
    """Defect: another SkyRL release without `_collate_rollout_expert_indices` got "installed", nothing swapped."""
    preprocess, _, _, integration = skyrl
    mask = preprocess.make_router_padding_mask
    monkeypatch.delattr(preprocess, "_collate_rollout_expert_indices")
    with pytest.raises(RuntimeError, match=r"skyrl.train.dataset.preprocess has no _collate_rollout_expert_indices"):
        integration.install()
    assert preprocess.make_router_padding_mask is mask
    assert not hasattr(preprocess, "_collate_rollout_expert_indices")
    monkeypatch.undo()
    integration.install().uninstall()  # nothing was left installed: a later install() is not refused


@pytest.mark.parametrize(
    "lengths",
    [[torch.tensor(2), torch.tensor(3)], torch.tensor([2, 3]), [np.int64(2), np.uint8(3)], np.array([2, 3])],
    ids=["0-d tensors", "1-d tensor", "numpy scalars", "numpy array"],
)
def test_in_range_lengths_as_tensors_or_numpy_integers_are_accepted(skyrl, lengths):
    """Defect: in-range lengths given as tensors were refused with a message saying they were out of range."""
    preprocess, _, _, integration = skyrl
    attention = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    expected = preprocess.make_router_padding_mask(attention, [2, 3])
    assert torch.equal(integration.make_router_padding_mask(attention, lengths), expected)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([torch.tensor(2.0), 3], r"captured_route_lengths\[0\]: expected an integer, got a torch.float32 tensor"),
        ([torch.tensor([2, 1]), 3], r"captured_route_lengths\[0\]: expected an integer, got a tensor of shape \[2\]"),
        ([2, 5], r"captured_route_lengths\[1\]: 5 is out of range \[0, 4\]"),
        ([True, 3], r"captured_route_lengths\[0\]: expected an integer, got True"),
    ],
)
def test_lengths_that_are_not_in_range_integers_are_refused_saying_what_they_are(skyrl, lengths, message):
    _, _, _, integration = skyrl
    attention = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises((TypeError, ValueError), match=message):
        integration.make_router_padding_mask(attention, lengths)


def test_an_aliased_binding_is_swapped_and_restored_whether_imported_before_or_after_install(
    skyrl, tmp_path, monkeypatch
):
    """Defect (issue 43.5): `from ...preprocess import make_router_padding_mask as mask_fn` kept torch_r3's
    function after `uninstall()` (and, imported before `install()`, was never swapped)."""
    import importlib
    import sys

    preprocess, _, _, integration = skyrl
    original = preprocess.make_router_padding_mask
    line = "from skyrl.train.dataset.preprocess import make_router_padding_mask as mask_fn\n"
    (tmp_path / "alias_before_r3.py").write_text(line)
    (tmp_path / "alias_after_r3.py").write_text(line)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("alias_before_r3", "alias_after_r3"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = importlib.import_module("alias_before_r3")
    handle = integration.install()
    try:
        after = importlib.import_module("alias_after_r3")
        assert before.mask_fn is integration.make_router_padding_mask
        assert after.mask_fn is integration.make_router_padding_mask
    finally:
        handle.uninstall()
    assert before.mask_fn is original and after.mask_fn is original
    assert preprocess.make_router_padding_mask is original


@pytest.mark.parametrize("error", [AttributeError, KeyboardInterrupt])
def test_an_install_refused_half_way_leaves_every_module_as_it_was(skyrl, monkeypatch, error):
    """Defect (issue 43.6): one loaded module refused the assignment (a read-only module object, or any
    exception, KeyboardInterrupt included); the names swapped before it kept torch_r3's functions."""
    import sys
    import types

    preprocess, _, _, integration = skyrl
    collate, mask = preprocess._collate_rollout_expert_indices, preprocess.make_router_padding_mask

    class Frozen(types.ModuleType):
        def __setattr__(self, name, value):
            raise error(f"{self.__name__} is read-only")

    frozen = Frozen("frozen_trainer_r3")
    frozen.__dict__["make_router_padding_mask"] = mask  # bound at its import, before it was frozen
    user = types.ModuleType("user_trainer_r3")
    user.collate = collate
    monkeypatch.setitem(sys.modules, frozen.__name__, frozen)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    with pytest.raises(error, match="read-only"):
        integration.install(worker=False)
    assert preprocess._collate_rollout_expert_indices is collate and user.collate is collate
    assert preprocess.make_router_padding_mask is mask and frozen.make_router_padding_mask is mask
    monkeypatch.delitem(sys.modules, frozen.__name__)
    integration.install(worker=False).uninstall()  # nothing was left installed: a later install() is not refused
    assert preprocess._collate_rollout_expert_indices is collate and user.collate is collate
