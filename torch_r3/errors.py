"""The package's failure types for remote data, in a module of their own.

`WireFormatError` is what every wire decoder raises for malformed data: the
codec's, the `.npy` reader's, the protocols' and the indexer wire's, all of
which import it from here (it stays importable from `torch_r3.rollout.codec`, as it
always was). `RemoteGenerateError` is the client's: the transport raises it for
every failed request and the client for every answer that breaks its server's
format; both import it from here, so neither owns the other's error.

This module imports nothing beyond the standard library: both names work
without aiohttp installed (an `except` clause can name them where the client is
optional).
"""

from __future__ import annotations

__all__ = ["RemoteGenerateError", "WireFormatError"]


class WireFormatError(ValueError):
    """Malformed wire data: the one exception every decoder raises for it.

    A `ValueError`, so `except ValueError` keeps working. The message names the
    field (or sample) and what was expected.
    """


class RemoteGenerateError(RuntimeError):
    """A generate call failed for good: a non-retryable answer, or retries exhausted.

    The message names the URL and the last cause; the cause is also chained
    (`__cause__`) when it was an exception.

    Attributes:
        url: The URL that was requested.
        status: The last HTTP status, or `None` when no response arrived.
        attempts: Attempts made.
    """

    def __init__(self, message: str, *, url: str, status: int | None = None, attempts: int = 1) -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.attempts = attempts
