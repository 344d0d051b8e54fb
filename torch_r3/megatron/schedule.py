"""`MicrobatchSchedule`: the per-step microbatch contract both Megatron replay hooks keep.

`torch_r3.megatron.ReplayHook` (the routes) and
`torch_r3.megatron.IndexerReplayHook` (the DSA selections) each replay one
payload inside Megatron's pipeline schedule, microbatch by microbatch. The
contract around the payload is the same for both and is written here once:

* `step()`'s bracket (`_stepping`): steps do not nest, a closed hook refuses
  one, the per-step state is cleared before and after, and a clean exit runs
  the payload's own end-of-step checks (`_finish_step`);
* `forward_backward` (`_run_schedule`): Megatron's schedule inside one step,
  with the forward step wrapped;
* `wrap_forward_step`: the data iterator checked, one microbatch taken from it
  per forward step (its exhaustion named against the schedule's count), opened
  before the forward step and closed after it;
* `begin_microbatch` / `end_microbatch`, for a trainer whose forward step
  cannot be wrapped;
* `close()` refused during a step, and the context manager;
* `next_recompute`: activation recompute takes the payload it replays from the
  hook's per-layer queue, oldest first, and a recompute past the last one is
  refused with the hook's own message.

A subclass calls `MicrobatchSchedule.__init__` and provides `_closed`,
`_install(batch, index)` (check and install one microbatch, numbered from 0 in
the step), `_finish_microbatch()` (its forward is done), `_clear()` (its own
per-step state), `_finish_step()` and `_detach()` (what `close()` undoes).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

__all__: list[str] = []  # the hooks' internals

_Hook = TypeVar("_Hook", bound="MicrobatchSchedule")
_Queued = TypeVar("_Queued")


class MicrobatchSchedule:
    """Base of a Megatron replay hook: one step at a time, one open microbatch at a time."""

    def __init__(self) -> None:
        self._in_step = False
        self._forward_only = False
        self._num_microbatches: int | None = None
        self._microbatch = 0  # microbatches begun in this step
        self._open: Mapping[str, Any] | None = None  # the microbatch begin_microbatch installed

    # ------------------------------------------------------ what a subclass provides

    @property
    def _closed(self) -> bool:
        raise NotImplementedError

    def _install(self, batch: Mapping[str, Any], index: int) -> None:
        raise NotImplementedError

    def _finish_microbatch(self) -> None:
        """The open microbatch's forward is done."""

    def _clear(self) -> None:
        """Reset the payload's per-step state."""

    def _finish_step(self) -> None:
        """A step's clean exit: the payload's checks and statistics."""

    def _detach(self) -> None:
        """Give the model back what the hook changed."""

    # ------------------------------------------------------------------ the contract

    def _run_schedule(self, forward_backward_func: Callable | None, kwargs: dict[str, Any], **step: Any) -> Any:
        """Megatron's schedule (by default `get_forward_backward_func()`) inside `self.step(**step)`."""
        if "forward_step_func" not in kwargs:
            raise TypeError("forward_backward: forward_step_func= is required")
        if forward_backward_func is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            forward_backward_func = get_forward_backward_func()
        kwargs["forward_step_func"] = self.wrap_forward_step(kwargs["forward_step_func"])
        with self.step(  # type: ignore[attr-defined]  # each hook's own step(), with its own options
            forward_only=bool(kwargs.get("forward_only", False)),
            num_microbatches=kwargs.get("num_microbatches"),
            **step,
        ):
            return forward_backward_func(**kwargs)

    def _check_can_step(self) -> None:
        name = type(self).__name__
        if self._in_step:
            raise RuntimeError(f"{name}.step() is already active; steps do not nest")
        if self._closed:
            raise RuntimeError(f"{name}.step(): the hook is closed; build a new {name} for this model")

    @contextlib.contextmanager
    def _stepping(self, *, forward_only: bool, num_microbatches: int | None) -> Iterator[None]:
        """The bracket of one step: refuse a nested or closed one, clear before and after, finish on a clean exit."""
        self._check_can_step()
        self._in_step = True
        self._forward_only = forward_only
        self._num_microbatches = num_microbatches
        self._reset()
        try:
            yield
            self._finish_step()
        finally:
            self._reset()
            self._in_step = False

    def _reset(self) -> None:
        self._open = None
        self._microbatch = 0
        self._clear()

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Wrap a Megatron `forward_step_func(data_iterator, model)` to replay each microbatch.

        For each microbatch the wrapper takes the next dict from
        `data_iterator`, opens it (`begin_microbatch`: checked and installed),
        calls `forward_step_func` with an iterator that yields that dict once,
        and closes it (`end_microbatch`) as soon as it returns.

        Args:
            forward_step_func: Your forward step, Megatron's signature.

        Returns:
            The wrapped forward step; its signature looks like yours to Megatron.

        Raises:
            ValueError: When the data iterator runs out before the schedule's
                last microbatch, or a microbatch's payload is invalid.
            RuntimeError: Outside `step()`, or when `forward_step_func` reads
                more than one microbatch from its iterator.
        """
        if not callable(forward_step_func):
            raise TypeError(f"forward_step_func: expected a callable, got {type(forward_step_func).__name__}")
        name = type(self).__name__

        @functools.wraps(forward_step_func)
        def replaying_forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                raise RuntimeError(
                    f"the replaying forward step ran outside {name}.step(); use "
                    "hook.forward_backward(...) or `with hook.step(): ...`"
                )
            batch = self._next_microbatch(data_iterator)
            self.begin_microbatch(batch)
            try:
                return forward_step_func(iter((batch,)), model, *args, **kwargs)
            except StopIteration as err:  # would silently end a caller's for loop
                raise RuntimeError(
                    f"forward_step_func called next() on the data iterator more than once for "
                    f"microbatch {self._microbatch - 1}; with {name} it yields exactly the one "
                    "microbatch it installed"
                ) from err
            finally:
                self.end_microbatch()

        return replaying_forward_step

    def begin_microbatch(self, batch: Mapping[str, Any]) -> None:
        """Check and install one microbatch, for a trainer whose forward step cannot be wrapped.

        What `wrap_forward_step` does around your forward step, in two calls:
        this one before the model runs, `end_microbatch` after. Inside `step()`
        only; a microbatch still open is ended first.
        """
        name = type(self).__name__
        if not self._in_step:
            raise RuntimeError(f"{name}.begin_microbatch() outside {name}.step()")
        self.end_microbatch()
        index = self._microbatch
        self._microbatch += 1
        self._install(batch, index)
        self._open = batch

    def end_microbatch(self) -> None:
        """The open microbatch's forward is done (recompute replays what it used). Idempotent."""
        if self._open is None:
            return
        self._open = None
        self._finish_microbatch()

    def _next_microbatch(self, data_iterator: Any) -> Any:
        if data_iterator is None:
            raise TypeError(
                f"data_iterator is None on this pipeline stage; with {type(self).__name__} every "
                "stage's data_iterator must yield the microbatch dicts (they carry what is replayed)"
            )
        if isinstance(data_iterator, (list, tuple)):
            raise TypeError(
                "data_iterator: expected one iterator, got a list (interleaved schedules are not supported)"
            )
        try:
            return next(data_iterator)
        except StopIteration:
            arrived = self._microbatch
            if self._num_microbatches is not None:
                which = f"{arrived + 1} of {self._num_microbatches}"
            else:
                which = f"{arrived + 1} (the first)" if arrived == 0 else f"{arrived + 1}"
            got = "none arrived" if arrived == 0 else f"{arrived} arrived"
            raise ValueError(f"data_iterator ran out: the schedule asked for microbatch {which}, {got}") from None

    def close(self) -> None:
        """Give the model back what the hook changed. The hook is also a context manager.

        Raises:
            RuntimeError: During a step (inside `step()` or `forward_backward`):
                the model would run without replay for the rest of it.
        """
        if self._in_step:
            raise RuntimeError(
                f"{type(self).__name__}.close() during a step: the model would run without replay for the "
                "rest of it; close the hook after forward_backward returns"
            )
        self._detach()

    def __enter__(self: _Hook) -> _Hook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def next_recompute(queue: list[_Queued], refusal: str, **pieces: object) -> _Queued:
    """Take the oldest entry of a layer's recompute `queue`, for activation recompute to replay.

    Args:
        queue: What the forwards of this step installed and recompute has not yet replayed, oldest first.
        refusal: The message when `queue` is empty, a `str.format` template of `pieces`:
            it is formatted only then, so that a recompute pays for no message.
        **pieces: The template's fields (the layer, the hook's counts).

    Raises:
        RuntimeError: `queue` is empty: recompute ran more often than the step's forwards installed.
    """
    if not queue:
        raise RuntimeError(refusal.format(**pieces))
    return queue.pop(0)
