"""Whether the server behind a remote URL answers, asked once with a short timeout.

gcsfs retries a refused connection for over a minute and then reports an
unreachable endpoint as a missing file ("dataset path does not exist").
:func:`require_reachable` opens one TCP connection to the endpoint gcsfs
would use, in a few seconds at most, and raises a UserError naming the
endpoint and the connection error instead. Call it where a remote location
is first used for reading (a dataset being built), not on every request: a
checkpoint save during an outage wants gcsfs's retries, not a refusal.

Standard library only: importing it loads neither fsspec nor gcsfs.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

from octfw.display.errors import UserError
from octfw.storage.files import GCS_PROTOCOLS

__all__ = ["TIMEOUT_S", "endpoint_of", "require_reachable", "unreachable"]

#: Seconds one probe may take, name lookup included.
TIMEOUT_S = 5.0


def endpoint_of(url: str) -> tuple[str, str] | None:
    """(endpoint URL, a note on where it came from) of a remote URL, or None when octfw does not
    know which server it talks to (a local path, another protocol).

    For ``gs://`` it is the endpoint gcsfs uses: ``STORAGE_EMULATOR_HOST``
    (an emulator; ``http://`` when it names no scheme) or Google's.
    """
    protocol = url.split("://", 1)[0] if "://" in url else ""
    if protocol not in GCS_PROTOCOLS:
        return None
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator not in ("", "default"):
        if not emulator.startswith(("http://", "https://")):
            emulator = f"http://{emulator}"
        return emulator, "; the endpoint is STORAGE_EMULATOR_HOST's"
    return "https://storage.googleapis.com", ""


def _connect(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout``, else why not."""
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or str(exc) or type(exc).__name__)

    # A thread: create_connection's timeout does not bound the name lookup.
    thread = threading.Thread(target=probe, name="octfw-reach", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer in {timeout:g} s"


def unreachable(url: str, timeout: float = TIMEOUT_S) -> str | None:
    """``cannot reach <endpoint> (<error>)`` when the server behind ``url`` does not accept a
    connection within ``timeout`` seconds; None when it does, for a local path, or a protocol
    without a known endpoint. (A save that overruns asks it, to say *why*.)"""
    found = endpoint_of(str(url))
    if found is None:
        return None
    endpoint, origin = found
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return f"{endpoint!r}: not a valid endpoint URL{origin}"
    error = _connect(host, port, timeout) if host else "no host in the URL"
    return None if error is None else f"cannot reach {endpoint} ({error}){origin}"


def require_reachable(url: str, setting: str | None = None, timeout: float = TIMEOUT_S) -> None:
    """UserError ``<setting>: cannot reach <endpoint> (<error>)`` (see :func:`unreachable`)."""
    error = unreachable(url, timeout)
    if error is not None:
        named = f"{setting} = {str(url)!r}" if setting else repr(str(url))
        raise UserError(f"{named}: {error}")
