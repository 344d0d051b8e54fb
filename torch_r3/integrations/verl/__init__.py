"""`torch_r3` inside verl (tested against `verl==0.9.1`).

* Agent loop (`agent_loop`): each sample's routes kept compact and unpadded
  (`compact_sample_routes`), or put into Ray's object store
  (`torch_r3.ray.put_trajectory`), in place of the zero-filled int16
  `[1, P + R, L, K]` per sample that `experimental/agent_loop/agent_loop.py`
  writes; then, on the driver, the exact tensors verl consumes, in one write:
  its prompt-left/response-right `routed_experts` (`padded_routed_experts`) or,
  skipping that, the jagged nested tensor `left_right_2_no_padding` makes of
  it (`nested_routed_experts`), and a replay mask per token
  (`replay_mask`: verl's `build_r3_replay_mask` marks every row but each
  sequence's last; this one marks exactly the captured rows).
* Megatron engine (`engine`): `microbatch(...)` turns verl's no-padding batch
  (nested `routed_experts` and `input_ids`) into the packed batch
  `torch_r3.megatron.ReplayHook` replays, in place of
  `align_r3_router_replay_data`, `build_r3_replay_mask` and
  `set_router_replay_data` (`utils/megatron/router_replay_utils.py`).

* One call for both (`install()`): verl's agent loop keeps each sample's
  routes compact in its `DataProto` and its driver writes the nested tensor
  from them; verl's Megatron engine step replays through `ReplayHook`
  (`schedule`). `Installed.uninstall()` puts verl's functions back, wherever
  they are bound.

verl is imported only by `install()`; the other functions take and return plain tensors.
"""

from __future__ import annotations

from torch_r3.integrations.verl.agent_loop import (
    ROUTES_FIELD,
    compact_sample_routes,
    driver_routed_experts,
    keep_compact,
    nested_routed_experts,
    padded_routed_experts,
    replay_mask,
)
from torch_r3.integrations.verl.engine import captured_lengths, microbatch
from torch_r3.integrations.verl.install import Installed, install
from torch_r3.integrations.verl.schedule import EngineReplay, thd_alignment

__all__ = [
    "ROUTES_FIELD",
    "EngineReplay",
    "Installed",
    "captured_lengths",
    "compact_sample_routes",
    "driver_routed_experts",
    "install",
    "keep_compact",
    "microbatch",
    "nested_routed_experts",
    "padded_routed_experts",
    "replay_mask",
    "thd_alignment",
]
