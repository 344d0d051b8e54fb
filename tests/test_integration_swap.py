"""`torch_r3.integrations.swap.Swaps`, framework-free: real module objects in `sys.modules`, real `import`s.

The home module and its users are module objects registered in `sys.modules`
(the state an `import` leaves); a module imported while swapped is a real file
imported from a temporary folder. Every assertion compares identities with the
functions as they were before the swap.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from torch_r3.integrations.swap import Swaps


def original_f(x):
    return ("f", x)


def original_g(x):
    return ("g", x)


def ours_f(x):
    return ("ours f", x)


def ours_g(x):
    return ("ours g", x)


class ReadOnly(types.ModuleType):
    """A module object that refuses every assignment to `refused` (a frozen or proxied module)."""

    refused: tuple[str, ...] = ()
    error: type[BaseException] = AttributeError

    def __setattr__(self, name, value):
        if name in type(self).refused:
            raise type(self).error(f"{self.__name__} is read-only")
        super().__setattr__(name, value)


@pytest.fixture
def modules(monkeypatch):
    """`swap_home` defines f and g; `swap_user` imported them as `from swap_home import f as to_nested, g`."""
    home = types.ModuleType("swap_home")
    home.f, home.g = original_f, original_g
    user = types.ModuleType("swap_user")
    user.to_nested, user.g = original_f, original_g
    for m in (home, user):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return home, user


def read_only(monkeypatch, name, bindings, refused, error):
    cls = type("Refusing", (ReadOnly,), {"refused": refused, "error": error})
    module = cls(name)
    module.__dict__.update(bindings)  # what its own `from ... import` wrote before it was frozen
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_every_binding_under_any_name_is_swapped_and_put_back(modules):
    home, user = modules
    swaps = Swaps()
    swaps.everywhere(home, "f", ours_f)
    assert home.f is ours_f and user.to_nested is ours_f
    assert home.g is original_g and user.g is original_g
    assert swaps.swapped == ["swap_home.f"]
    swaps.undo()
    assert home.f is original_f and user.to_nested is original_f
    swaps.undo()  # a second call does nothing
    assert home.f is original_f


def test_a_module_imported_while_swapped_gets_the_original_back_under_its_alias(modules, tmp_path, monkeypatch):
    home, _ = modules
    (tmp_path / "swap_late_user.py").write_text("from swap_home import f as mask_fn\nfrom swap_home import g\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "swap_late_user", raising=False)
    swaps = Swaps()
    swaps.everywhere(home, "f", ours_f)
    swaps.everywhere(home, "g", ours_g)
    late = importlib.import_module("swap_late_user")
    assert late.mask_fn is ours_f and late.g is ours_g
    swaps.undo()
    assert late.mask_fn is original_f and late.g is original_g
    assert home.f is original_f and home.g is original_g


def test_a_module_that_held_the_replacement_before_keeps_it(modules, monkeypatch):
    home, user = modules
    ours_user = types.ModuleType("swap_ours_user")  # `from torch_r3... import ours_f` before the swap
    ours_user.ours_f = ours_f
    monkeypatch.setitem(sys.modules, ours_user.__name__, ours_user)
    swaps = Swaps()
    swaps.everywhere(home, "f", ours_f)
    swaps.undo()
    assert ours_user.ours_f is ours_f
    assert home.f is original_f and user.to_nested is original_f


@pytest.mark.parametrize("error", [AttributeError, TypeError, KeyboardInterrupt])
def test_a_swap_refused_half_way_is_undone_in_every_module(modules, monkeypatch, error):
    home, user = modules
    frozen = read_only(monkeypatch, "swap_frozen", {"g_alias": original_g, "f": original_f}, ("g_alias",), error)
    swaps = Swaps()
    with pytest.raises(error, match="read-only"):
        swaps.everywhere(home, "f", ours_f)  # swapped everywhere, the frozen module's f included
        swaps.everywhere(home, "g", ours_g)  # home.g swapped, then the frozen module refuses its alias
    assert home.g is ours_g and frozen.f is ours_f  # half-way: what undo() must put back
    swaps.undo()
    assert home.f is original_f and user.to_nested is original_f and frozen.f is original_f
    assert home.g is original_g and user.g is original_g and frozen.g_alias is original_g


def test_an_owned_attribute_is_put_back_or_removed_when_it_was_absent():
    class Engine:
        def step(self):
            return "verl"

    original = Engine.__dict__["step"]
    module = types.ModuleType("swap_owner")
    swaps = Swaps()
    swaps.owned(Engine, "step", lambda self: "ours")
    swaps.owned(module, "_marker", True)
    assert Engine().step() == "ours" and module._marker is True
    assert swaps.swapped[0].endswith("Engine.step") and swaps.swapped[1] == "swap_owner._marker"
    swaps.undo()
    assert Engine.__dict__["step"] is original and not hasattr(module, "_marker")


def test_undo_leaves_a_binding_someone_changed_since(modules):
    home, user = modules
    swaps = Swaps()
    swaps.everywhere(home, "f", ours_f)
    user.to_nested = len  # the user's own choice, after the swap
    swaps.undo()
    assert user.to_nested is len and home.f is original_f


def test_a_missing_name_is_refused_before_anything_is_swapped(modules):
    home, user = modules
    swaps = Swaps()
    with pytest.raises(AttributeError, match="h"):
        swaps.everywhere(home, "h", ours_f)
    assert home.f is original_f and swaps.swapped == []
