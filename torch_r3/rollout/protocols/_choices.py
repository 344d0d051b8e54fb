"""What the `choices[0]` formats read alike: the route payload by `RouteLimits`, and the log-prob content list.

The torch_r3 server and SkyRL send the torch_r3 route envelope, vLLM's two
endpoints a whole `.npy` file; vLLM's native endpoint and SkyRL send the
log-probs as `{"content": [{"logprob": x, ...}, ...]}` and take `logprobs: 1`
in `sampling_params` for the sampled token's. Each server's module keeps what
is its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from torch_r3.rollout.codec import WireFormatError, decode_routes, decode_vllm_routes
from torch_r3.rollout.protocols import fields
from torch_r3.rollout.protocols._lists import entry_logprobs
from torch_r3.rollout.protocols.base import ChoicesProtocol

if TYPE_CHECKING:
    from torch_r3.rollout.protocols.base import GenerateCall, RouteLimits

_WHERE = "choices[0].routed_experts"


def envelope_routes(payload: Any, limits: RouteLimits) -> np.ndarray:
    """`choices[0].routed_experts` as the torch_r3 envelope (`{data, shape, dtype}`), checked against `limits`."""
    return decode_routes(
        payload,
        name=_WHERE,
        max_bytes=limits.max_bytes,
        num_layers=limits.num_layers,
        topk=limits.topk,
        num_experts=limits.num_experts,
    )


def npy_routes(payload: Any, limits: RouteLimits) -> np.ndarray:
    """`choices[0].routed_experts` as vLLM's base64 `.npy`; its shape is checked when `limits` know both sizes."""
    known = limits.num_layers is not None and limits.topk is not None
    return decode_vllm_routes(
        payload,
        num_layers=limits.num_layers if known else None,
        topk=limits.topk if known else None,
        num_experts=limits.num_experts,
        max_bytes=limits.max_bytes,
        name=_WHERE,
    )


def params_with_logprobs(call: GenerateCall) -> dict[str, Any]:
    """`fields.params_with_start`, asking for the sampled token's log-prob (`logprobs: 1`) unless the caller set it."""
    params = fields.params_with_start(call)
    params.setdefault("logprobs", 1)  # the sampled token's logprob, which RL needs
    return params


def content_logprobs(choice: Mapping[str, Any], ids: tuple[int, ...], *, check_ids: bool) -> tuple[float, ...] | None:
    """`choices[0].logprobs.content[i].logprob`, one per generated token, or `None` without a log-prob block.

    Args:
        choice: The answer's first choice.
        ids: Its generated token ids.
        check_ids: Each entry also names its `token_id`, which must be `ids[i]` (vLLM's native endpoint).

    Raises:
        WireFormatError: The block has no `content` list, holds another number
            of entries, or an entry breaks the format.
    """
    block = fields.get_field(choice, "logprobs", "choices[0]", dict, required=False)
    if block is None:
        return None
    content = fields.get_field(block, "content", "choices[0].logprobs", list)
    if len(content) != len(ids):
        raise WireFormatError(f"choices[0].logprobs.content has {len(content)} entries for {len(ids)} tokens")
    fast = entry_logprobs(content, ids if check_ids else None, null_is_nan=False)  # a few C passes; else the loop
    if fast is not None:
        return fast
    values = []
    for i, entry in enumerate(content):
        where = f"choices[0].logprobs.content[{i}]"
        if check_ids and fields.get_field(entry, "token_id", where, int) != ids[i]:
            raise WireFormatError(f"{where}.token_id {entry['token_id']!r} is not token_ids[{i}] = {ids[i]}")
        values.append(fields.logprob(fields.get_field(entry, "logprob", where, (int, float)), f"{where}.logprob"))
    return tuple(values)


class ContentLogprobsProtocol(ChoicesProtocol):
    """A vLLM-based `choices[0]` format (vLLM's native endpoint, SkyRL's) that reads the log-probs' content list.

    It asks for the sampled token's log-prob with `logprobs: 1` (`params_with_logprobs`),
    reads `choices[0].logprobs.content` (`content_logprobs`), keys the prefix cache
    with `cache_salt`, and may get every row back from position 0 (the start ignored).

    Attributes:
        check_logprob_ids: Whether each content entry names its token id, checked against the generated ids.
    """

    salt_field = "cache_salt"
    start_may_be_ignored = True
    check_logprob_ids: ClassVar[bool]

    def sampling_params(self, call: GenerateCall) -> dict[str, Any]:
        return params_with_logprobs(call)

    def read_logprobs(self, choice: Mapping[str, Any], ids: tuple[int, ...]) -> tuple[float, ...] | None:
        return content_logprobs(choice, ids, check_ids=self.check_logprob_ids)
