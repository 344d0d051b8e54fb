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

verl is imported by none of this: its inputs and outputs are plain tensors.
"""

from __future__ import annotations

from torch_r3.integrations.verl.agent_loop import (
    compact_sample_routes,
    nested_routed_experts,
    padded_routed_experts,
    replay_mask,
)
from torch_r3.integrations.verl.engine import captured_lengths, microbatch

__all__ = [
    "captured_lengths",
    "compact_sample_routes",
    "microbatch",
    "nested_routed_experts",
    "padded_routed_experts",
    "replay_mask",
]
