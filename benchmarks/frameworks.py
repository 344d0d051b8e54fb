"""SkyRL 0.4.0's and verl 0.9.1's own route collation beside `torch_r3.integrations`, in one process.

Run it where the trainers are installed (`make frameworks` builds `.venv-frameworks`):

    PYTHONPATH=. .venv-frameworks/bin/python benchmarks/frameworks.py [--batch 192] [--rounds 5]

* SkyRL, packed (its controller): `preprocess._collate_rollout_expert_indices`
  against `torch_r3.integrations.skyrl.collate_rollout_expert_indices`, fresh
  and with a `BufferPool`.
* SkyRL, padded (its Megatron worker, `remove_microbatch_padding=False`): its
  `align_packed_token_metadata` + `align_token_metadata` of one micro-batch
  against `torch_r3.integrations.skyrl.microbatch`.
* SkyRL, its Megatron worker step set-up (`skyrl_worker_step`): SkyRL's
  replay alignment and installation for every micro-batch of one step against
  `install(worker=True)`'s, per step and per token, at SkyRL's defaults.
* verl (its agent loop, then its driver): a zero-filled int16 `[1, P + R, L, K]`
  per sample (the agent loop's three tensor operations: zeros, one slice copy,
  `torch.cat` of the batch), then verl's own `left_right_2_no_padding`, against
  `torch_r3.integrations.verl.nested_routed_experts` from the compact samples.
* verl's step, agent loop to actor (`verl_agent_loop_step`): from the server's
  per-sample routes to the actor's nested `routed_experts`, verl's path against
  `install()`'s (`keep_compact` per sample, `driver_routed_experts`), per step
  and per token, and the bytes shipped from agent loop to driver.
* verl's engine step set-up (`verl_engine_step`): what `MegatronEngine`'s
  `forward_backward_batch` and `forward_step` do for R3 replay (its
  `RouterReplayHelper` path: `align_r3_router_replay_data`,
  `build_r3_replay_mask`, `set_router_replay_data`) for every micro-batch of
  one THD step, against `install()`'s (`EngineReplay` and the hook), per step
  and per token.

Every output is checked equal to the framework's before timing counts. After
one warm-up round the cases run in interleaved rounds (each once per round) and the table gives
medians: on a loaded machine, read the ratios, not the absolute figures. SkyRL's
and verl's modules are loaded behind bare parent packages, as the tests load them
(`tests/integrations/frameworks.py`). A framework that is not installed is skipped.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.frameworks_common import installed
from benchmarks.frameworks_skyrl import skyrl, skyrl_worker_step
from benchmarks.frameworks_verl import verl, verl_agent_loop_step, verl_engine_step

__all__ = ["main", "skyrl", "skyrl_worker_step", "verl", "verl_agent_loop_step", "verl_engine_step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument(
        "--step-batch", type=int, default=16, help="trajectories in the SkyRL worker step (micro-batches of 1)"
    )
    ap.add_argument(
        "--verl-micro-batch", type=int, default=4, help="samples per micro-batch in the verl engine step (THD)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (SkyRL's and verl's copies are torch ops; on a loaded 2-core machine "
        "2 threads made them up to 10x slower than 1, so 1, their best there, is the default)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    from importlib.metadata import version

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); one warm-up round, then "
        f"{args.rounds} interleaved rounds, medians (on a loaded machine: read the ratios)"
    )
    for name, run in (("skyrl", skyrl), ("verl", verl), ("verl", verl_agent_loop_step)):
        if not installed(name):
            print(f"\n{name}: not installed here, skipped (make frameworks builds .venv-frameworks with it)")
            continue
        setattr(args, name, version(name))
        run(args)
        if name == "skyrl" and installed("megatron"):
            skyrl_worker_step(args)
        if run is verl_agent_loop_step and installed("megatron"):
            verl_engine_step(args)


if __name__ == "__main__":
    main()
