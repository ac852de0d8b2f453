"""What the training loop keeps between log steps.

:class:`DeviceTotals`: running sums on the device (the loss, applied and
skipped updates, per-domain losses), read in one transfer at a log step.
:class:`GuardLog`: which samples fed the last few update steps, written to
``guard_events.jsonl`` when a guard acts.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import torch

from octfw.engine.backend import Backend
from octfw.engine.distributed import all_reduce_
from octfw.types import ModelOutput, Provenance

__all__ = ["DeviceTotals", "GuardLog", "PROVENANCE_WINDOW", "device_metrics", "model_metrics"]

#: The key under which :func:`device_metrics` hands the model's health Gram matrix to the one read.
_HEALTH_GRAM = "health_gram"


def provenance_record(provenance: Provenance) -> dict[str, Any]:
    """What the guard event log lists of one sample: its file and domain."""
    return {"source": provenance.source, "domain": provenance.domain}


def device_metrics(out: ModelOutput) -> dict[str, torch.Tensor]:
    """What a log step reads of the model's output: its ``metric/*`` scalars and, when it
    gives one, its health Gram matrix (read in the same transfer)."""
    values = {f"metric/{k}": v for k, v in out.metrics.items()}
    if out.health_gram is not None:
        values[_HEALTH_GRAM] = out.health_gram
    return values


def model_metrics(host: dict[str, Any], out: ModelOutput) -> dict[str, Any]:
    """``host`` (as read) with the health Gram matrix replaced by its spectrum metrics
    (``metric/rankme``, ``metric/rankme_max``), computed on the host."""
    gram = host.pop(_HEALTH_GRAM, None)
    if gram is not None:
        import numpy as np

        from octfw.models.health import spectrum_metrics

        matrix = np.asarray(gram, dtype=np.float64).reshape(out.health_gram.shape)
        host.update({f"metric/{k}": v for k, v in spectrum_metrics(matrix).items()})
    return host

PROVENANCE_WINDOW = 8  # update steps whose sample URLs are kept for guard reports


class GuardLog:
    """Writes which samples fed the update steps around a guard event.

    Step numbers here, as in metrics.jsonl, count updates from 1: step N is
    the N-th update (``octfw replay RUN_DIR --step N`` rebuilds it)."""

    def __init__(self, run_dir: Path | None):
        self.path = run_dir / "guard_events.jsonl" if run_dir else None
        self.window: collections.deque = collections.deque(maxlen=PROVENANCE_WINDOW)

    def remember(self, update_step: int, provenance: list) -> None:
        self.window.append((update_step, provenance))  # formatted only when written

    def write(self, update_step: int, event: str) -> None:
        if self.path is None:
            return
        record = {"step": update_step, "event": event,
                  "recent_batches": [{"step": s, "samples": [provenance_record(p) for p in batch]}
                                     for s, batch in self.window]}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class DeviceTotals:
    """Running sums kept on the device between log steps (no sync until read)."""

    def __init__(self, device: torch.device, n_domains: int):
        zeros = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        self.skipped = zeros(())  # whole run
        self.loss, self.applied = zeros(()), zeros(())  # since the last log step
        self.domain_loss, self.domain_count = zeros(n_domains), zeros(n_domains)

    def add_domain_losses(self, out: ModelOutput, domain_ids: torch.Tensor) -> None:
        """A micro-step's per-sample losses, summed by the domain of each sample."""
        per_sample = out.per_sample_loss.detach().float()
        self.domain_loss.index_add_(0, domain_ids, per_sample)
        self.domain_count.index_add_(0, domain_ids, torch.ones_like(per_sample))

    def add_update(self, applied: torch.Tensor, step_loss: torch.Tensor) -> None:
        """An update step's loss, counted where ``applied`` (a device bool), else a skipped update."""
        self.skipped += (~applied).float()
        self.loss += torch.where(applied, step_loss, 0.0)
        self.applied += applied.float()

    def reset_interval(self) -> None:
        for t in (self.loss, self.applied, self.domain_loss, self.domain_count):
            t.zero_()

    def read(self, backend: Backend, **extra: torch.Tensor) -> dict[str, Any]:
        """The interval's means, summed over DDP ranks, and ``extra``, in one
        device-to-host transfer. Note: a sync point (log steps only)."""
        ranks = 1
        if backend.across_processes:  # sums over the processes; SPMD's are global already
            all_reduce_(self.loss, self.applied, self.domain_loss, self.domain_count)
            ranks = backend.world_size
        return backend.read({
            "loss": self.loss / self.applied.clamp(min=1.0),
            "applied": self.applied / ranks,
            "skipped_updates": self.skipped,
            "domain_loss": self.domain_loss / self.domain_count.clamp(min=1.0),
            "domain_count": self.domain_count,
            **extra,
        })
