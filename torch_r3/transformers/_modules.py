"""What both `transformers` replay hooks find in a model and how they follow its checkpointed layers.

The routes hook (`torch_r3.transformers.hook`) and the DSA indexer hook
(`torch_r3.transformers.indexer`) each hold modules that sit inside decoder
layers (routers, indexers). Written once here:

* `find_in_layers`: walk an instance's module tree for the modules a hook
  replays, tell each one's decoder layer (`<anything>.layers.<i>`) and how
  many decoder layers the model has;
* `device_of`: where a module's parameters live;
* `note_inputs`: a `record()` block's forward pre-hook, keeping the `[B, T]`
  of its input and where its `attention_mask` is 0;
* `LayerCalls`: `transformers` runs each decoder layer's forward through the
  layer instance's `_gradient_checkpointing_func`; wrapping that function
  gives each checkpointed call a record of its own (what the hooked modules
  returned in it), which the recompute in backward finds again.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__: list[str] = []  # the hooks' internals

# `<anything>.layers.<i>` names decoder layer i in every supported family (also under DDP's `module.`).
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")
_CHECKPOINTING = "_gradient_checkpointing_func"
_OWNER = "_torch_r3_hook"  # set on a checkpointing wrapper: the LayerCalls it records into


@dataclass
class Found:
    """One hooked module: its name in the tree, its decoder layer (0-based) and that layer's module."""

    module: torch.nn.Module
    name: str
    layer: int
    layer_module: torch.nn.Module


def find_in_layers(
    model: torch.nn.Module, pick: Callable[[str, torch.nn.Module], bool], what: str
) -> tuple[list[Found], int]:
    """The modules `pick(name, module)` accepts, each in its decoder layer, and the model's number of decoder layers.

    `what` names the modules in messages ("a router", "an indexer"). The caller
    refuses an empty result with its own message.

    Raises:
        ValueError: When a picked module is outside any decoder layer, or the
            picked modules sit in more than one list of decoder layers.
    """
    found, containers = [], set()
    for name, module in model.named_modules():
        if not pick(name, module):
            continue
        matches = list(_LAYER.finditer(name))
        if not matches:
            raise ValueError(f"{name} ({type(module).__name__}): {what} outside any decoder layer (…layers.<i>…)")
        last = matches[-1]
        containers.add(name[: last.start(1) - 1])
        found.append(Found(module, name, int(last.group(1)), model.get_submodule(name[: last.end(1)])))
    if not found:
        return found, 0
    if len(containers) != 1:
        plural = what.split(" ", 1)[1] + "s"
        raise ValueError(f"model: {plural} in more than one list of decoder layers: {sorted(containers)}")
    num_layers = len(list(model.get_submodule(containers.pop()).children()))
    return found, num_layers


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of the module's first parameter (CPU when it has none)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def note_inputs(rec: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook of `record()`: set `rec.shape` (`[B, T]` of the input) and `rec.mask` (`attention_mask == 0`)."""
    ids = args[0] if args else kwargs.get("input_ids")
    if ids is None and kwargs.get("inputs_embeds") is not None:
        ids = kwargs["inputs_embeds"][..., 0]
    if isinstance(ids, torch.Tensor) and ids.ndim == 2:
        rec.shape = (int(ids.shape[0]), int(ids.shape[1]))
    attention = kwargs.get("attention_mask")
    if isinstance(attention, torch.Tensor) and attention.ndim == 2:
        rec.mask = attention == 0


class LayerCalls:
    """The checkpointed layer call running now (`current`: its record, or `None`), for one hook.

    `wrap(layers)` wraps each layer's `_gradient_checkpointing_func` (once per
    `LayerCalls`): each checkpointed call gets a fresh record from
    `new_record()`, and `current` is that record while the layer's forward
    runs, in the first run and in its recompute alike.
    """

    def __init__(self, new_record: Callable[[], Any]):
        self.current: Any = None
        self._new_record = new_record

    def wrap(self, layers: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, Callable]]:
        """Wrap the layers' checkpointing functions not wrapped by this `LayerCalls` yet; `(layer, original)` of each."""
        wrapped = []
        for layer in {id(m): m for m in layers}.values():
            original = layer.__dict__.get(_CHECKPOINTING)
            if original is not None and getattr(original, _OWNER, None) is not self:
                layer.__dict__[_CHECKPOINTING] = self._checkpointing(original)
                wrapped.append((layer, original))
        return wrapped

    def restore(self, wrapped: Iterable[tuple[torch.nn.Module, Callable]], *, only_own: bool = True) -> None:
        """Hand each layer its own checkpointing function back.

        With `only_own` (default) only where this `LayerCalls`' wrapper is still
        the layer's function; otherwise whatever wraps it now is dropped too.
        """
        for layer, original in wrapped:
            if not only_own or getattr(layer.__dict__.get(_CHECKPOINTING), _OWNER, None) is self:
                layer.__dict__[_CHECKPOINTING] = original

    def _checkpointing(self, original: Callable) -> Callable:
        def checkpoint_with_record(function: Callable, *args: Any, **kwargs: Any) -> Any:
            record = self._new_record()  # filled by the first run, replayed by the recompute

            def run(*a: Any, **k: Any) -> Any:
                outer, self.current = self.current, record
                try:
                    return function(*a, **k)
                finally:
                    self.current = outer

            return original(run, *args, **kwargs)

        setattr(checkpoint_with_record, _OWNER, self)
        return checkpoint_with_record
