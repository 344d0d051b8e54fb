"""SkyRL at cluster scale: rollouts as `TrajectoryRef`s, each trainer rank collating only its own micro-batches.

SkyRL 0.4.0's controller collates the whole step's batch
(`convert_to_training_input`), then its dispatcher pads the mini-batch to a
multiple of the data-parallel size, chunks it and `ray.put`s each chunk for the
workers (`backends/skyrl_train/distributed/dispatch.py`,
`training_batch.py`'s pickling): the global batch's routes pass through the
controller's memory and are serialised once more per chunk.

Here the generator puts each trajectory into Ray's object store once
(`put_rollouts`, on the process that generated it; it must stay alive until the
trainers have fetched) and the controller passes only `TrajectoryRef`s (about
200 bytes each) and a micro-batch plan (`torch_r3.plan_microbatches`) to the
workers; each worker iterates `shard_batches(...)`, a
`torch_r3.ShardCollator(torch_r3.ray.RefFetch(refs), ...)`, whose batches
`torch_r3.megatron.ReplayHook` replays. This replaces, for the routes, SkyRL's
controller collation and its dispatcher's pad-chunk-put of the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch_r3.collate.shard import ShardCollator
from torch_r3.keys import INPUT_IDS, SAMPLE_ROUTES

__all__ = ["LOSS_MASK", "PROMPT_LENGTH", "put_rollouts", "shard_batches"]

LOSS_MASK = "loss_mask"
"""The sample key for a trajectory's per-token loss mask (zeros on the prompt, SkyRL's on the response)."""

PROMPT_LENGTH = "prompt_length"
"""The sample key for a trajectory's prompt token count."""


def _ray() -> Any:
    from torch_r3 import ray as r3_ray  # the `ray` extra; named by its error when missing

    return r3_ray


def put_rollouts(generator_output: Mapping[str, Any]) -> list[Any]:
    """Put each trajectory of SkyRL's `GeneratorOutput` into the object store once; return its refs.

    Args:
        generator_output: SkyRL's generator output with `prompt_token_ids`,
            `response_ids`, `loss_masks` and `rollout_expert_indices` (one
            `[rows, L, K]` array per trajectory, compacted by SkyRL's server).

    Returns:
        One `torch_r3.ray.TrajectoryRef` per trajectory, in order: its sample
        holds `routes`, `input_ids` (prompt then response), `loss_mask`
        (zeros on the prompt) and `prompt_length`.

    Raises:
        ValueError: a missing field, or fields of different lengths.
        TypeError, ValueError: as `torch_r3.ray.put_trajectory` (naming the key).
    """
    fields = ("prompt_token_ids", "response_ids", "loss_masks", "rollout_expert_indices")
    for key in fields:
        if generator_output.get(key) is None:
            raise ValueError(f"generator_output: missing {key!r} (SkyRL fills it with routed-expert replay on)")
    sizes = {key: len(generator_output[key]) for key in fields}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"generator_output: fields of different lengths {sizes}")
    r3_ray = _ray()
    refs = []
    for prompt, response, loss, routes in zip(*(generator_output[key] for key in fields)):
        refs.append(
            r3_ray.put_trajectory(
                {
                    SAMPLE_ROUTES: routes,
                    INPUT_IDS: list(prompt) + list(response),
                    LOSS_MASK: [0] * len(prompt) + list(loss),
                    PROMPT_LENGTH: len(prompt),
                }
            )
        )
    return refs


def shard_batches(
    refs: Mapping[int, Any] | Sequence[Any], microbatches: Sequence[Sequence[int]], **options: Any
) -> ShardCollator:
    """This rank's micro-batches, fetched from the object store and collated, for `ReplayHook`.

    Args:
        refs: the `TrajectoryRef`s of this rank's trajectories (by global index).
        microbatches: this rank's micro-batches of global indices
            (`torch_r3.plan_microbatches(...)[rank]`).
        **options: `torch_r3.ShardCollator`'s (`layout=torch_r3.Padded(seq_len=)`
            and `dtype=` from `torch_r3.global_geometry` for global-batch-identical
            micro-batches, `Padded(side="right", pad_to_multiple_of=)` for SkyRL's
            Megatron layout, `memory=`, `prefetch=`, ...); `loss_mask` is padded with 0.

    Returns:
        A `ShardCollator` over `RefFetch(refs)`.
    """
    options.setdefault("pad_keys", {LOSS_MASK: 0})
    return ShardCollator(_ray().RefFetch(refs), microbatches, **options)
