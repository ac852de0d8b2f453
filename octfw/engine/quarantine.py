"""Unusable files met while loading, each recorded once per run: ``quarantine.jsonl`` and a warning.

Rank 0 warns once per quarantined file (logger ``octfw.engine.quarantine``)
and lists it in ``quarantine.jsonl`` of the run directory; the samples that
skipped a file carry it (:class:`~octfw.engine.data.SampleSource`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

__all__ = ["Quarantine"]

logger = logging.getLogger(__name__)


class Quarantine:
    """Unusable files, each recorded once, in ``quarantine.jsonl`` of the run directory
    and in one warning each (where there is a run directory: rank 0).

    Once per run, not per process: a resumed run starts from the files its
    ``quarantine.jsonl`` lists already, so a file hit again after a resume is
    neither written nor warned about a second time. The other processes of a
    job keep what they met in :attr:`unshared` until the trainer hands it to
    every process (:meth:`take_unshared`, then :meth:`record` with ``heard``),
    so that rank 0 lists every rank's files and every process counts the job's.
    """

    def __init__(self, run_dir: Path | None):
        self.path = run_dir / "quarantine.jsonl" if run_dir is not None else None
        self.seen: dict[str, str] = {}
        #: files this process met that the job's other processes have not heard of (not rank 0)
        self.unshared: list[tuple[str, str]] = []
        if self.path is not None and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.seen[entry["url"]] = entry["reason"]
                except (ValueError, TypeError, KeyError):
                    continue  # a line cut short by a killed process: the file is met again

    def record(self, entries: list[tuple[str, str]], *, heard: bool = False) -> None:
        """Files met by this process, or (``heard``) by another process of the job."""
        new = []
        for url, reason in entries:  # one batch may list a file twice: two samples skipped it
            if url not in self.seen:
                self.seen[url] = reason
                new.append((url, reason))
        if new and self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                for url, reason in new:
                    f.write(json.dumps({"url": url, "reason": reason}) + "\n")
                    logger.warning("quarantined %s, training goes on: %s", url, reason)
        elif new and not heard:
            self.unshared += new

    def take_unshared(self) -> list[tuple[str, str]]:
        """What this process met since it last shared (and forget it: it is being shared)."""
        taken, self.unshared = self.unshared, []
        return taken

    def __len__(self) -> int:
        return len(self.seen)
