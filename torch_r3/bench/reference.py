"""Every strategy's output checked bit for bit against the first output of its layout.

`torch-r3 bench` and the DataLoader bench time only collations that produced
exactly the reference batch: `check_identical` compares two outputs,
`packed_from_padded` cuts a padded reference to the packed layout, and
`Reference` keeps the first output of each layout and checks the rest.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from torch_r3.keys import CU_SEQLENS, ROUTER_MASK, ROUTES

__all__ = ["Reference", "check_identical", "packed_from_padded"]


class _Strategy(Protocol):
    """What `Reference.check` reads of a `torch_r3.bench.strategies.Strategy`."""

    @property
    def name(self) -> str: ...

    @property
    def layout(self) -> str | None: ...


def packed_from_padded(ref: dict[str, torch.Tensor], counts: list[int]) -> dict[str, torch.Tensor]:
    """The packed batch that corresponds to a padded one (arange padding).

    With arange padding a padding row does not depend on its position, so the
    packed batch is the padded one with each row's left padding cut off.

    Args:
        ref: a padded batch.
        counts: its token counts.

    Returns:
        `rollout_expert_indices`, `router_padding_mask` and `cu_seqlens` of the packed layout.
    """
    T = ref[ROUTES].shape[1]
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(counts), 0)
    return {
        ROUTES: torch.cat([ref[ROUTES][i, T - n :] for i, n in enumerate(counts)]),
        ROUTER_MASK: torch.cat([ref[ROUTER_MASK][i, T - n :] for i, n in enumerate(counts)]),
        CU_SEQLENS: cu,
    }


def check_identical(name: str, got: dict[str, Any], want: dict[str, torch.Tensor], first: str) -> None:
    """Raise unless `got` holds every tensor of `want`, bit for bit (dtype, shape and values).

    Args:
        name: the strategy that produced `got`.
        got: its output.
        want: the reference output.
        first: the strategy that produced `want`.

    Raises:
        AssertionError: a key is missing or differs; the message names it.
    """
    for key, w in want.items():
        g = got.get(key)
        if g is None or g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            detail = "missing" if g is None else f"{g.dtype} {list(g.shape)} vs {w.dtype} {list(w.shape)}"
            raise AssertionError(f"strategy {name!r}: {key} is not bit-identical to {first!r}'s ({detail})")


class Reference:
    """The first output of each layout, which every later strategy's output must equal.

    A packed output is checked against the padded reference cut to the packed
    layout (`packed_from_padded`); if the packed strategy runs first, it is
    checked as soon as a padded reference exists.

    Args:
        counts: the batch's token counts.
    """

    def __init__(self, counts: list[int]):
        self.counts = counts
        self.padded: dict[str, torch.Tensor] | None = None
        self.packed: dict[str, torch.Tensor] | None = None
        self.padded_from = self.packed_from = ""
        #: strategy -> the strategy whose output it was checked against (None: it is a reference).
        self.checked_against: dict[str, str | None] = {}

    def check(self, strategy: _Strategy, out: dict[str, torch.Tensor] | None) -> None:
        """Compare `out` with the reference of its layout, or make it that reference.

        Raises:
            AssertionError: `out` differs from the reference.
        """
        if out is None or strategy.layout is None:
            return
        name = strategy.name
        if strategy.layout == "packed":
            if self.packed is None and self.padded is not None:
                self.packed, self.packed_from = packed_from_padded(self.padded, self.counts), self.padded_from
            if self.packed is None:
                self.packed, self.packed_from, self.checked_against[name] = out, name, None
                return
            check_identical(name, out, self.packed, self.packed_from)
            self.checked_against[name] = self.packed_from
            return
        if self.padded is None:
            self.padded, self.padded_from, self.checked_against[name] = out, name, None
            if self.packed is not None:  # a packed strategy ran first: check it now
                packed_name = self.packed_from
                check_identical(packed_name, self.packed, packed_from_padded(out, self.counts), name)
                self.checked_against[packed_name] = name
            return
        check_identical(name, out, self.padded, self.padded_from)
        self.checked_against[name] = self.padded_from

    def release(self) -> None:
        """Drop the reference outputs (before the timed runs, to free their memory)."""
        self.padded = self.packed = None
