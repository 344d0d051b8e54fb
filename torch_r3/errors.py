"""The client's failure type, `RemoteGenerateError`, in a module of its own.

The transport raises it for every failed request and the client for every
answer that breaks its server's format; both import it from here, so neither
owns the other's error. This module imports nothing beyond the standard
library: `torch_r3.RemoteGenerateError` works without aiohttp installed (an
`except` clause can name it where the client is optional).
"""

from __future__ import annotations

__all__ = ["RemoteGenerateError"]


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
