"""The checks every replay hook makes on a batch's route tensors, with no training framework imported.

The Megatron hook and the `transformers` hook receive the same `R3Collator`
batch and refuse the same mistakes, so the rules live here once:

* `check_route_batch`: keys, dtypes and shapes of the dict (padded
  `[B, T, L, K]` with `router_padding_mask [B, T]`, or packed `[N, L, K]` with
  `cu_seqlens`);
* `check_replayed_ids`: every replayed route holds `K` distinct ids in
  `[0, num_experts)`, with the first bad route named (hook prefix, layer,
  position, value);
* `check_router_tokens`: at the router call, one route per token it sees;
* `check_route_tensors`: `rollout_expert_indices` is an integer tensor of a
  route dtype and `router_padding_mask` a bool tensor (`TypeError` otherwise);
* `first_bad_route`: the first replayed route whose `K` ids are not distinct
  ids in `[0, num_experts)`, found with whole-tensor reductions and one host
  sync when the batch is clean (a bad id that reaches a router fails deep in
  `gather`, or on a GPU kills the CUDA context; a duplicate trains silently
  on the wrong experts);
* `bad_route_message`: what is wrong with that route, in one wording;
* `route_position`: where it is (row and token, or sequence and token in the
  packed layout).

Each hook adds its own prefix (`"microbatch 0, "` or none) and its own name for
the expert count.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torch_r3.health._hints import ZERO_ROUTES_HINT
from torch_r3.keys import CU_SEQLENS, ROUTER_MASK, ROUTES

__all__: list[str] = []

ROUTE_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)
"""The torch dtypes a batch's routes may have (what `R3Collator` produces, and int64)."""


def check_route_tensors(routes: Any, mask: Any) -> None:
    """`routes` a tensor of a route dtype and `mask` a bool tensor; a `TypeError` naming the key otherwise."""
    check_tensor_dtype(routes, ROUTES, ROUTE_DTYPES, "a uint8/int16/int32/int64 torch.Tensor")
    check_tensor_dtype(mask, ROUTER_MASK, (torch.bool,), "a torch.bool tensor")


def check_tensor_dtype(value: Any, key: str, dtypes: tuple[torch.dtype, ...], expected: str) -> None:
    """`value` a tensor of one of `dtypes`; a `TypeError` naming `key` and what was `expected` otherwise."""
    if not isinstance(value, torch.Tensor) or value.dtype not in dtypes:
        what = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{key}: expected {expected}, got {what}")


def _fits(view: torch.Tensor, num_experts: int) -> bool:
    # Compare with scalars the dtype can hold: `uint8 >= 256` would wrap 256 to 0.
    return num_experts <= torch.iinfo(view.dtype).max


CHUNK_IDS = 1 << 18
"""Route ids one duplicate pass compares at a time: its `K - 1` rows of flags stay in cache."""

TAGGED_CHUNK_IDS = 1 << 19
"""The same for the tagged pass (`_repeated_ids_tagged`), whose chunks carry fewer passes each."""


@functools.lru_cache(maxsize=16)
def _pair_words(k: int, device: torch.device) -> torch.Tensor:
    """`[K - 1, 1]` int64 masks over 8 flag bytes: byte `i` of row `s - 1` is set when ids `i, i + s` share a route.

    Only for `8 % k == 0`, where every 8 consecutive ids hold whole routes.
    """
    words = []
    for s in range(1, k):
        words.append(sum(0xFF << (8 * i) for i in range(8) if i % k + s < k))
    return torch.tensor(words, dtype=torch.int64, device=device).view(k - 1, 1)


@functools.lru_cache(maxsize=16)
def _pairs(k: int, device: torch.device) -> torch.Tensor:
    """`[K - 1, K]` bool: lane `j` of row `s - 1` is set when lanes `j, j + s` lie in one route."""
    lane = torch.arange(k, device=device)
    return (lane.view(1, k) + torch.arange(1, k, device=device).view(k - 1, 1)) < k


def _repeated_ids(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Whether any route of `flat` (`[M * K]`, contiguous, routes back to back) repeats an id, as a 0-d bool.

    Id `i` is compared with ids `i + 1 .. i + K - 1` in one broadcast `eq` over
    the flat ids (an overlapping strided view, so the inner loop is contiguous);
    pairs that cross into the next route are masked off afterwards, per 8 flag
    bytes at a time when `K` divides 8, else per route. No loop over layers or
    experts: a chunk loop bounds the scratch, `K - 1` flag bytes per id.
    """
    n = flat.numel()
    last = flat[n - k :]  # the last route's later ids have no K - 1 ids after them: compared on their own
    found = [(last.unsqueeze(0) == last.unsqueeze(1)).sum() > k]
    usable = n - (k - 1)  # ids with K - 1 ids after them
    chunk = max(CHUNK_IDS // (8 * k) * 8 * k, 8 * k)
    words = _pair_words(k, flat.device) if 8 % k == 0 else None
    flags = torch.empty((k - 1) * min(chunk, n), dtype=torch.bool, device=flat.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        width = min(b, usable) - a
        rows = flags[: (k - 1) * (b - a)].view(k - 1, b - a)  # contiguous: the kernels' fast path
        if width > 0:
            ahead = flat.as_strided((k - 1, width), (1, 1), flat.storage_offset() + a + 1)
            torch.eq(ahead, flat[a : a + width], out=rows[:, :width])
        rows[:, max(width, 0) :] = False
        if words is not None and (b - a) % 8 == 0:
            bits = rows.view(torch.uint8).view(torch.int64)
            bits &= words
            found.append(bits.max() > 0)
        else:
            pairs = _pairs(k, flat.device).view(k - 1, 1, k)
            found.append((rows.view(k - 1, -1, k) & pairs).view(torch.uint8).max() > 0)
    return torch.stack(found).any()


def _tag_bit(dtype: torch.dtype, num_experts: int) -> int | None:
    """A bit no valid id of `dtype` sets, when there is one: the sign bit, or uint8's bit 7 below 129 experts.

    An id with that bit set is out of range, so the range check refuses the batch
    whatever the repeat check says of it.
    """
    if dtype.is_signed:
        return torch.iinfo(dtype).min
    if num_experts <= 128:
        return 0x80
    return None


class _Scratch(threading.local):
    """Per thread and device: the tag pattern, the tagged ids and the flag bytes, grown as batches grow."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def take(self, key: tuple, numel: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The first `numel` entries of the buffer kept under `key`; `make(numel)` builds it when it is short."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = make(numel)
            self.buffers[key] = buffer
        return buffer[:numel]


_SCRATCH = _Scratch()


def _repeated_ids_tagged(flat: torch.Tensor, k: int, tag: int) -> torch.Tensor:
    """`_repeated_ids` for ids that never set `tag`'s bit when valid: one pass fewer, no mask.

    Every odd route's ids get the bit (an `xor`, so ids equal within a route stay
    equal and distinct ones distinct), and a `K`-id route of the other parity
    follows the last: an id compared with the next route's can then never match,
    and every id has `K - 1` ids after it. A match across routes needs an id with
    the bit set, which the range check refuses (see `_tag_bit`). The flags are
    reduced as bytes; scratch is kept per thread, so a steady stream of
    microbatches allocates nothing.
    """
    n, device, dtype = flat.numel(), flat.device, flat.dtype

    def empty(of: torch.dtype) -> Callable[[int], torch.Tensor]:
        return lambda size: torch.empty(size, dtype=of, device=device)

    def tags(size: int) -> torch.Tensor:  # `0` for the ids of even routes, `tag` for odd ones: period `2 * K`
        return torch.tensor([0] * k + [tag] * k, dtype=dtype, device=device).repeat(-(-size // (2 * k)))

    pattern = _SCRATCH.take(("pattern", k, tag, dtype, device), n + k, tags)
    tagged = _SCRATCH.take(("tagged", dtype, device), n + k, empty(dtype))
    torch.bitwise_xor(flat, pattern[:n], out=tagged[:n])
    # The route after the last takes the parity after the last route's: tagged after an untagged route.
    tagged[n:] = pattern[k : 2 * k] if (n // k) % 2 else 0
    chunk = max(TAGGED_CHUNK_IDS, 1)
    flags = _SCRATCH.take(("flags", device), (k - 1) * min(chunk, n), empty(torch.bool))
    found = []
    for a in range(0, n, chunk):
        width = min(a + chunk, n) - a
        rows = flags[: (k - 1) * width].view(k - 1, width)
        torch.eq(tagged.as_strided((k - 1, width), (1, 1), a + 1), tagged[a : a + width], out=rows)
        found.append(rows.view(torch.uint8).max())
    return (torch.stack(found).max() if len(found) > 1 else found[0]) > 0


def _any_bad(view: torch.Tensor, num_experts: int) -> bool:
    """Fast path over the whole tensor: any id out of range or repeated in a route, anywhere?

    A few whole-tensor passes over the compact ids, one host sync: the range
    from one `max` (`aminmax` for signed dtypes), repeats from `_repeated_ids`.
    Filler rows are checked too; a batch whose filler would fail (`filler="zeros"`)
    takes the exact per-route path, which honours `checked`.
    """
    if view.numel() == 0:
        return False
    flat = view.reshape(-1)  # a view of a contiguous batch; a copy of a layer subset
    flags = []
    if view.dtype.is_signed:
        low, high = torch.aminmax(flat)
        flags.append(low < 0)
    else:  # uint8 routes cannot be negative
        high = flat.max()
    if _fits(view, num_experts):
        flags.append(high >= num_experts)
    k = view.shape[-1]
    if k > 1:
        tag = _tag_bit(view.dtype, num_experts)
        flags.append(_repeated_ids(flat, k) if tag is None else _repeated_ids_tagged(flat, k, tag))
    return bool(torch.stack(flags).any()) if flags else False


def bad_rows(view: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per route `[B, T, L]`: out of range or repeated (only run when `_any_bad` found something)."""
    bad = torch.zeros(view.shape[:-1], dtype=torch.bool, device=view.device)
    if _fits(view, num_experts):
        bad |= (view >= num_experts).any(-1)
    if view.dtype.is_signed:
        bad |= (view < 0).any(-1)
    for shift in range(1, view.shape[-1]):
        bad |= (view[..., shift:] == view[..., :-shift]).any(-1)
    return bad


def first_bad_route(
    view: torch.Tensor, checked: torch.Tensor, num_experts: int
) -> tuple[int, int, int, list[int]] | None:
    """`(b, t, j, route)` of the first bad route in batch order among the `checked` positions, or `None`.

    Args:
        view: `[B, T, L, K]` routes, any integer dtype, the columns to check only.
        checked: `[B, T]` bool, `True` where the route will be replayed
            (filler rows that are never replayed may hold anything).
        num_experts: The routers' expert count.

    Examples:
        >>> routes = torch.tensor([[[[0, 1]], [[2, 2]]]])  # B=1, T=2, L=1, K=2
        >>> first_bad_route(routes, torch.tensor([[True, False]]), 8) is None
        True
        >>> first_bad_route(routes, torch.tensor([[True, True]]), 8)
        (0, 1, 0, [2, 2])
    """
    if not _any_bad(view, num_experts):  # the one host sync of a clean batch
        return None
    bad_row = bad_rows(view, num_experts) & checked.to(view.device).unsqueeze(-1)
    if not bool(bad_row.any()):
        return None
    b, t, j = (int(x) for x in bad_row.nonzero()[0])
    return b, t, j, view[b, t, j].tolist()


def bad_route_message(route: list[int], num_experts: int, *, experts: str) -> str:
    """What is wrong with a route `first_bad_route` found; `experts` says the count as the model names it.

    Examples:
        >>> bad_route_message([2, 9], 8, experts="8 experts")
        'expert id 9 outside [0, 8) in route [2, 9] (the model has 8 experts)'
        >>> print(bad_route_message([0, 0], 8, experts="8 experts"))
        expert id 0 twice in one route [0, 0]; ... (an all-zero route is what an uncaptured layer sends: vLLM's ...
    """
    outside = [e for e in route if not 0 <= e < num_experts]
    if outside:
        return f"expert id {outside[0]} outside [0, {num_experts}) in route {route} (the model has {experts})"
    twice = next(e for e in route if route.count(e) > 1)
    message = f"expert id {twice} twice in one route {route}; the K={len(route)} experts of a token must be distinct"
    if not any(route):
        message += f" (an all-zero route is what an uncaptured layer sends: {ZERO_ROUTES_HINT})"
    return message


def route_position(b: int, t: int, cu_seqlens: torch.Tensor | None) -> str:
    """A position as the batch's layout names it: row and token, or (packed, `b == 0`) sequence and token."""
    if cu_seqlens is None:
        return f"row {b}, token {t}"
    bounds = cu_seqlens.tolist()
    seq = max(i for i, start in enumerate(bounds[:-1]) if start <= t)
    return f"sequence {seq}, token {t - bounds[seq]}"


def check_route_batch(
    batch: Any, topk: int, *, what: str = "batch"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check a collated batch's route keys, dtypes and shapes.

    Args:
        batch: The dict `R3Collator` (or `collate_routes`) produced.
        topk: The model's experts per token (`K`).
        what: What the hook calls the dict, for the messages (`"batch"`, `"microbatch"`).

    Returns:
        `(routes, router_padding_mask, cu_seqlens or None)`, as the batch holds
        them: `[B, T, L, K]` and `[B, T]`, or packed `[N, L, K]` and `[N]`.

    Raises:
        TypeError: When `batch` is no mapping or a tensor has the wrong type.
        ValueError: When a key is missing or a shape is wrong.

    Examples:
        >>> routes, mask = torch.zeros((2, 3, 4, 2), dtype=torch.uint8), torch.zeros((2, 3), dtype=torch.bool)
        >>> [t.shape for t in check_route_batch({ROUTES: routes, ROUTER_MASK: mask}, 2)[:2]]
        [torch.Size([2, 3, 4, 2]), torch.Size([2, 3])]
        >>> check_route_batch({ROUTES: routes}, 2)
        Traceback (most recent call last):
        ...
        ValueError: batch: missing key 'router_padding_mask'
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"{what}: expected a dict from R3Collator, got {type(batch).__name__}")
    for key in (ROUTES, ROUTER_MASK):
        if key not in batch:
            raise ValueError(f"{what}: missing key {key!r}")
    routes, mask = batch[ROUTES], batch[ROUTER_MASK]
    check_route_tensors(routes, mask)
    cu_seqlens = batch.get(CU_SEQLENS)
    if cu_seqlens is not None:
        if routes.ndim != 3 or routes.shape[-1] != topk:
            raise ValueError(f"{ROUTES}: the packed layout expects [sum(n), L, K={topk}], got {list(routes.shape)}")
        if mask.shape != routes.shape[:1]:
            raise ValueError(f"{ROUTER_MASK}: the packed layout expects [{routes.shape[0]}], got {list(mask.shape)}")
        return routes, mask, cu_seqlens
    if routes.ndim != 4 or routes.shape[-1] != topk:
        raise ValueError(
            f"{ROUTES}: expected [B, T, L, K={topk}] (or [sum(n), L, K] with {CU_SEQLENS!r}), got {list(routes.shape)}"
        )
    if mask.shape != routes.shape[:2]:
        raise ValueError(f"{ROUTER_MASK}: expected [B, T] = {list(routes.shape[:2])}, got {list(mask.shape)}")
    return routes, mask, None


def check_replayed_ids(
    routes: torch.Tensor,
    checked: torch.Tensor,
    layers: Sequence[int],
    num_experts: int,
    *,
    prefix: str = "",
    experts: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    uncaptured: torch.Tensor | None = None,
) -> None:
    """Every checked route holds `K` distinct expert ids in `[0, num_experts)`.

    Args:
        routes: `[B, T, M, K]` (or packed `[N, M, K]` with `cu_seqlens`), the
            columns of the `M` replayed layers only, any integer dtype.
        checked: `[B, T]` (`[N]`) bool, `True` where the route will be replayed.
        layers: The model layer of each of the `M` columns, for the message.
        num_experts: The routers' expert count.
        prefix: Put before the message (`"microbatch 0, "`).
        experts: How the model names its expert count (default `"<n> experts"`).
        cu_seqlens: The packed layout's offsets, for the message.
        uncaptured: `router_padding_mask`, shaped like `checked`: an all-zero
            route at an uncaptured position (`filler="zeros"`) gets a message
            saying so.

    Raises:
        ValueError: At the first bad route in batch order, naming the layer,
            the position and the value.

    Examples:
        >>> routes = torch.tensor([[[[0, 1]], [[2, 2]]]])  # B=1, T=2, one layer, K=2
        >>> check_replayed_ids(routes, torch.tensor([[True, False]]), [3], 4)
        >>> check_replayed_ids(routes, torch.tensor([[True, True]]), [3], 4)
        Traceback (most recent call last):
        ...
        ValueError: layer 3: row 0, token 1: expert id 2 twice in one route [2, 2]; the K=2 experts of a token must be distinct
    """
    if cu_seqlens is not None and routes.ndim == 3:
        routes, checked = routes.unsqueeze(0), checked.unsqueeze(0)
        uncaptured = None if uncaptured is None else uncaptured.unsqueeze(0)
    found = first_bad_route(routes, checked, num_experts)  # the one host sync of a clean batch
    if found is None:
        return
    b, t, j, route = found
    message = bad_route_message(route, num_experts, experts=experts or f"{num_experts} experts")
    if uncaptured is not None and not any(route) and bool(uncaptured[b, t]):
        message += (
            "; an all-zero filler row (filler='zeros') is marked to replay, but a route needs K distinct "
            "experts (Megatron's dropless dispatcher relies on it): collate with filler='arange' or "
            "'balanced', or let uncaptured tokens route live (uncaptured='live')"
        )
    raise ValueError(f"{prefix}layer {layers[j]}: {route_position(b, t, cu_seqlens)}: {message}")


def check_router_tokens(
    tokens: int, rows: int, batch_rows: int, *, where: str, scope: str = "", hint: str = ""
) -> None:
    """At the router call: the router sees exactly one token per route.

    Args:
        tokens: Rows of the router's input (its scores' first dimension).
        rows: Routes prepared for it (`batch_rows * positions`).
        batch_rows: The batch's rows (1 for the packed layout).
        where: The hook's prefix, naming the layer (`"microbatch 0, layer 3"`).
        scope: Appended to the count (`" on this rank"`).
        hint: Appended to the message when the counts differ.

    Raises:
        ValueError: When the counts differ.

    Examples:
        >>> check_router_tokens(6, 6, 2, where="layer 0")
        >>> check_router_tokens(8, 6, 2, where="layer 1")
        Traceback (most recent call last):
        ...
        ValueError: layer 1: the router sees 8 tokens, the routes cover 6 (2 rows x 3 positions)
    """
    if tokens == rows:
        return
    positions = rows // max(batch_rows, 1)
    raise ValueError(
        f"{where}: the router sees {tokens} tokens, the routes cover {rows} "
        f"({batch_rows} rows x {positions} positions{scope}){hint}"
    )


def check_input_shape(routes_shape: Sequence[int], input_shape: Sequence[int], *, where: str, name: str) -> None:
    """The routes cover exactly the model input's `[B, S]`, not only as many tokens.

    Args:
        routes_shape: `[B, S]` of the batch's routes (its `router_padding_mask`).
        input_shape: Shape of what the model gets (`input_ids`, or `attention_mask`).
        where: The hook's prefix for the message (`"microbatch 0, layer 3"`).
        name: What `input_shape` is the shape of.

    Raises:
        ValueError: When the shapes differ, naming the first token without a route.

    Examples:
        >>> check_input_shape([2, 6], [3, 4], where="layer 1", name="input_ids")
        Traceback (most recent call last):
        ...
        ValueError: layer 1: the routes have 2 rows, input_ids has shape [3, 4] (the routes are [2, 6])
    """
    if tuple(routes_shape) == tuple(input_shape):
        return
    prefix = f"{where}: "
    if len(input_shape) != 2 or routes_shape[0] != input_shape[0]:
        raise ValueError(
            prefix + f"the routes have {routes_shape[0]} rows, {name} has shape {list(input_shape)} "
            f"(the routes are {list(routes_shape)})"
        )
    have, want = routes_shape[1], input_shape[1]
    if have < want:
        raise ValueError(
            prefix + f"the routes cover {have} positions per row, {name} has {want}; "
            f"first token without a route: row 0, token {have}"
        )
    raise ValueError(prefix + f"the routes cover {have} positions per row, {name} has only {want}")
