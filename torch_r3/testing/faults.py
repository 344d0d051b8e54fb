"""Faults the loopback server injects on demand, the same for every protocol."""

from __future__ import annotations

import collections
import threading
from typing import Any

from torch_r3._checks import check_finite_float, check_int, check_non_negative

__all__ = ["Faults"]


class Faults:
    """Faults to inject, consumed in order by the next requests (thread-safe).

    Connection refusals apply to new TCP connections; every other fault applies
    to the next request that reaches the generate handler, one fault per
    request, in the order they were queued.

    Examples:
        >>> faults = Faults()
        >>> faults.status(503, n=2)
        >>> faults.stall(5.0)
        >>> faults.pending
        3
        >>> faults.next_fault()
        ('status', {'code': 503, 'message': 'injected 503', 'json_error': True})
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._refuse = 0

    def refuse_connections(self, n: int = 1) -> None:
        """Reset the next `n` TCP connections as soon as they are accepted.

        The client sees a connection-level error (`ClientOSError` /
        `ServerDisconnectedError`) before any byte of a response, as it would
        for a server that is not up yet. (For a genuinely closed port, see
        `LoopbackServer.restart`.)
        """
        with self._lock:
            self._refuse += _count(n)

    def disconnect(self, n: int = 1) -> None:
        """Send the status line, headers and half the body, then drop the connection."""
        self._push("disconnect", n)

    def status(self, code: int, n: int = 1, *, message: str | None = None, json_error: bool = True) -> None:
        """Answer with HTTP `code`: a `{"error": {"message"}}` body, or plain text when `json_error=False`."""
        code = check_int(code, "code")
        if not 100 <= code <= 599:
            raise ValueError(f"code must be an HTTP status in [100, 599], got {code}")
        self._push("status", n, code=code, message=message or f"injected {code}", json_error=json_error)

    def truncate(self, n: int = 1) -> None:
        """Answer `200` with a complete HTTP body holding only the first half of the JSON."""
        self._push("truncate", n)

    def malformed(self, n: int = 1) -> None:
        """Answer `200` with valid JSON whose route payload disagrees with its size.

        Our envelope claims one row more than its data holds; SGLang's raw ids
        lack their last id; vLLM's `.npy` header claims one row more.
        """
        self._push("malformed", n)

    def abort(self, n: int = 1) -> None:
        """Answer `200` as for a request aborted before any forward pass.

        No output tokens and an abort finish reason; the routes are `null`
        (vLLM, our format) or absent (SGLang).
        """
        self._push("abort", n)

    def stall(self, seconds: float, n: int = 1) -> None:
        """Wait `seconds` before handling the request (to outlast a client timeout)."""
        self._push("stall", n, seconds=check_finite_float(seconds, "seconds"))

    def clear(self) -> None:
        """Drop every pending fault."""
        with self._lock:
            self._queue.clear()
            self._refuse = 0

    @property
    def pending(self) -> int:
        """Faults not yet consumed (connection refusals included)."""
        with self._lock:
            return len(self._queue) + self._refuse

    def next_fault(self) -> tuple[str, dict[str, Any]] | None:
        """Consume the next request fault: `(kind, arguments)`, or `None` when none is queued."""
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def take_refusal(self) -> bool:
        """Consume one pending connection refusal; `False` when none is queued."""
        with self._lock:
            if self._refuse:
                self._refuse -= 1
                return True
            return False

    def _push(self, kind: str, n: int, **args: Any) -> None:
        with self._lock:
            self._queue.extend((kind, args) for _ in range(_count(n)))


def _count(n: Any) -> int:
    return check_non_negative(n, "n")
