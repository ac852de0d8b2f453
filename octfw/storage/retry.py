"""Retries of storage operations: exponential backoff, a deadline per attempt, one error at the end.

A network store fails now and then (a reset connection, a 503); another
attempt a moment later usually succeeds. gcsfs already retries transient
HTTP errors inside each call; this layer retries the whole operation and
bounds each attempt, so a store that stays away costs a known time and ends
in one :class:`StorageError` that names the operation.

Written here rather than taken from a retry library (tenacity, backoff):
the policy is twenty lines, and what octfw needs beyond backoff (a permanent
error raised at once, the deadline handed to fsspec, one error naming the
operation) would be configuration there.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

import attrs

from octfw.display.errors import UserError

__all__ = ["RetryPolicy", "StorageError", "is_permanent"]

T = TypeVar("T")


class StorageError(OSError):
    """A storage operation that still failed after every attempt."""


def is_permanent(exc: BaseException) -> bool:
    """Errors that another attempt cannot fix (a missing object, a refused state, a bad request)."""
    return isinstance(exc, (FileNotFoundError, PermissionError, TypeError, ValueError, UserError))


@attrs.frozen
class RetryPolicy:
    """How often, and how patiently, to try one storage operation.

    The default (no retries, no deadline) suits a local disk, where an error
    is not transient.
    """

    #: extra attempts after the first one failed
    retries: int = 0
    #: seconds before the first retry; the wait doubles with each retry
    backoff_s: float = 2.0
    #: seconds one attempt may take on an async filesystem (gcsfs); None: no deadline
    timeout_s: float | None = None
    #: how to wait (tests pass a recorder)
    sleep: Callable[[float], None] = time.sleep

    def options(self, fs: Any) -> dict[str, Any]:
        """Keyword arguments for a call on ``fs``: the deadline, where fsspec can enforce it."""
        if self.timeout_s is not None and getattr(fs, "async_impl", False):
            return {"timeout": self.timeout_s}  # fsspec cancels the request when it expires
        return {}

    def run(self, what: str, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``operation(*args, **kwargs)``, tried ``retries + 1`` times at most.

        A permanent error (:func:`is_permanent`) is raised at once; otherwise
        the last error is raised as a StorageError naming ``what``.
        """
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return operation(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - transient ones are retried, the rest re-raised
                if is_permanent(exc):
                    raise
                last = exc
        attempts = self.retries + 1
        raise StorageError(
            f"{what} failed after {attempts} attempt{'s' if attempts > 1 else ''}: "
            f"{type(last).__name__}: {last}"
        ) from last
