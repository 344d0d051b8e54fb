"""What a replay hook does with tokens that have no captured route, and the dtype of the routes it records.

* `UNCAPTURED` and `check_uncaptured`: `"live"` (the router's own top-k) or
  `"replay"` (the batch's filler route) for tokens whose `router_padding_mask`
  is `True`;
* `recorded_route_dtype`: the torch dtype a hook records routes in (R2), the
  narrowest canonical route dtype that holds the model's expert ids, as
  inference engines send them.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_r3._checks import check_choice, check_positive
from torch_r3.routes import canonical_dtype_for

__all__: list[str] = []  # the hooks' internals

UNCAPTURED = ("live", "replay")
"""The modes of `ReplayHook(uncaptured=)`: route uncaptured tokens live, or replay their filler route."""

_TORCH_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}


def check_uncaptured(value: Any) -> str:
    """`value` when it is one of `UNCAPTURED`.

    Examples:
        >>> check_uncaptured("own")
        Traceback (most recent call last):
        ...
        ValueError: uncaptured must be one of ['live', 'replay'], got 'own'
    """
    return check_choice(value, "uncaptured", UNCAPTURED)


def recorded_route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest canonical route dtype (`uint8`, `int16`, `int32`) that holds ids `0 .. num_experts - 1`.

    Examples:
        >>> recorded_route_dtype(256), recorded_route_dtype(257)
        (torch.uint8, torch.int16)
    """
    num_experts = check_positive(num_experts, "num_experts")
    return _TORCH_DTYPES[canonical_dtype_for(num_experts - 1).name]
