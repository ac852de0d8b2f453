"""A real GCS emulator over HTTP on 127.0.0.1, for tests of gs:// paths.

``gcp-storage-emulator`` runs in its own process; gcsfs talks to it through
``STORAGE_EMULATOR_HOST``. Use the ``gcs`` fixture from conftest.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["GCSEmulator"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GCSEmulator:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        # Without the HNS switch gcsfs spends 60 s on a gRPC probe per bucket.
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def start(self) -> "GCSEmulator":
        exe = Path(sys.executable).with_name("gcp-storage-emulator")
        self.process = subprocess.Popen(
            [str(exe), "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.wait_until_listening(30)
        return self

    def wait_until_listening(self, timeout_s: float, log: Path | None = None) -> None:
        """Return once the started emulator takes connections; raise at once if it exits (with the
        last line of ``log``, where its output goes), or after ``timeout_s``, stopping it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.process.poll() is not None:
                    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log else []
                    raise RuntimeError(f"gcp-storage-emulator exited at start: {tail}")
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not open its port within {timeout_s} s")

    def filesystem(self):
        """A fresh gcsfs filesystem pointed at this emulator (no instance cache)."""
        import gcsfs

        for key, value in self.env().items():
            os.environ[key] = value
        return gcsfs.GCSFileSystem(project="test", token="anon", skip_instance_cache=True)

    def make_bucket(self, name: str) -> None:
        self.filesystem().mkdir(name)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
