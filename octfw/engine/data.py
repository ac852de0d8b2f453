"""Loading: one sample from its ``(epoch, index)`` (:class:`SampleSource`), and this process's
batches of them (:func:`make_loader`), with its workers and their shared memory.

Every sample's randomness comes from ``(seed, epoch, index)``, so a batch does
not depend on worker count or timing and can be rebuilt later. A file the
dataset cannot use is quarantined and replaced by the next usable sample in
the same epoch order; no good file is dropped, and training never stops for
one bad file. The sample carries the files it skipped, which
:class:`octfw.engine.quarantine.Quarantine` records.

Prepared volumes are cached: when the transform has a deterministic
``prepare`` half with a ``cache`` (:class:`octfw.types.PreparingTransform`)
and the dataset names each volume's ``source`` without I/O
(:class:`octfw.types.SourcedDataset`), a cached volume skips reading and
decoding its file entirely; only the random half (views, masks) runs.

The loader's order comes from :mod:`octfw.engine.sampling`, its batches from
:func:`~octfw.engine.collate.collate`. How many workers load
(:func:`loader_workers`) and how much shared memory their ready batches hold
(:func:`loader_shared_memory`, logged by :func:`stating_shared_memory`) are
decided here.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from typing import Any, Iterator

import numpy as np
import torch

from octfw.display.errors import ContractError, CorruptFile, UserError
from octfw.display.tables import counted
from octfw.engine.collate import collate, collate_float_views
from octfw.engine.domains import dataset_domains
from octfw.engine.sampling import DOMAIN_SAMPLING, BalancedEpochOrder, EpochOrder, share_report
from octfw.storage.failures import format_bytes
from octfw.types import (DOMAIN_ID_KEY, Dataset, PreparedVolumesDataset, PreparingTransform, Provenance,
                         SourcedDataset, Transform)

__all__ = [
    "SampleSource", "make_loader", "PREFETCH_BATCHES", "loader_shared_memory", "stating_shared_memory",
    "MAX_AUTO_WORKERS", "loader_workers",
]

logger = logging.getLogger(__name__)


class SampleSource(torch.utils.data.Dataset):
    """Loads and transforms one ``(epoch, index)``; quarantines unusable files.

    With a caching transform and a dataset that names its sources, a
    prepared volume is read from the transform's cache; see the module
    docstring. A file found unusable is remembered (per process) so later
    epochs skip it without reading it again; it is still reported each time,
    and :class:`~octfw.engine.quarantine.Quarantine` records it once.
    """

    def __init__(self, dataset: Dataset, transform: Transform, seed: int,
                 domains: list[str] | None = None):
        self.dataset, self.transform, self.seed = dataset, transform, seed
        names = dataset_domains(dataset) if domains is None else domains
        self.domain_ids = {name: i for i, name in enumerate(names)}
        self._bad: dict[int, tuple[str, str]] = {}

    @property
    def cache(self) -> Any:
        """The transform's prepared-volume cache when both sides support it, else None."""
        if not isinstance(self.transform, PreparingTransform) or not isinstance(self.dataset, SourcedDataset):
            return None
        # A dataset of prepared volumes (``prepared``) is the cache already.
        return None if isinstance(self.dataset, PreparedVolumesDataset) else self.transform.cache

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, index = key
        skipped: list[tuple[str, str]] = []
        for attempt in range(len(self.dataset)):
            candidate = (index + attempt) % len(self.dataset)
            if candidate in self._bad:
                skipped.append(self._bad[candidate])
                continue
            rng = np.random.default_rng([self.seed, epoch, candidate])
            try:
                arrays, provenance = self._load(candidate, rng)
            except CorruptFile as bad:  # from decoding, or from a transform that cannot use it
                self._bad[candidate] = (bad.url, bad.reason)
                skipped.append((bad.url, bad.reason))
                continue
            try:
                domain_id = self.domain_ids[provenance.domain]
            except KeyError:
                raise ContractError(
                    f"{self.dataset!r}: the sample from {provenance.source} has domain "
                    f"{provenance.domain!r}, but dataset.domain() names only {sorted(self.domain_ids)}"
                ) from None
            arrays = {**arrays, DOMAIN_ID_KEY: np.int64(domain_id)}
            return {"arrays": arrays, "provenance": provenance, "quarantined": skipped}
        raise UserError(
            f"no usable file in the dataset: all {counted(len(self.dataset), 'file')} failed to load "
            f"(first: {skipped[0][0]}: {skipped[0][1]})"
        )

    def _load(self, index: int, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], Provenance]:
        cache = self.cache
        if cache is None:
            sample = self.dataset.load(index)
            return self.transform(sample, rng), sample.provenance
        source = self.dataset.source(index)
        hit = cache.get(source)
        if hit is not None:
            provenance = Provenance(
                source=source,
                domain=self.dataset.domain(index),
                spacing=hit.spacing,
                original_shape=hit.original_shape,
                label=self.dataset.label(index),
            )
            return self.transform.augment_and_mask(hit.prepared, rng), provenance
        sample = self.dataset.load(index)
        prepared = self.transform.prepare(sample)
        cache.put(source, prepared, sample.provenance)
        return self.transform.augment_and_mask(prepared, rng), sample.provenance


def make_loader(source: SampleSource, batch_size: int, seed: int, start: int,
                num_workers: int, rank: int = 0, world_size: int = 1,
                domain_sampling: str = "natural", views_to_device: bool = True,
                pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """This process's batches of ``source``, from its sample ``start`` on.

    ``start`` counts the samples this process has loaded so far (the
    trainer's ``samples_done``, as its checkpoints record it). Every process
    loads ``batch_size`` samples per micro-step, so ``start x world_size``
    samples of the shared stream are done: that is where this process's
    share resumes. Exact when the run resumes with the same number of
    processes that wrote the checkpoint; with another number the position is
    off by the ratio of the two (docs/tpu-pods.md).

    ``domain_sampling`` is ``"natural"`` (:class:`EpochOrder`) or
    ``"balanced"`` (:class:`BalancedEpochOrder`, over ``source.dataset``'s domains).
    With several processes, each logs one line (:func:`share_report`) saying
    which samples it loads, so the hosts of a slice can be compared.

    ``views_to_device``: views stay as stored (uint8 or float16) until the device converts
    them (:func:`float_views`, four or two times fewer bytes to move); False converts them
    in the loader, for the cpu device. A volume both views share travels once
    (:func:`collate`'s ``share_views``).

    ``pin_memory``: batches are copied into page-locked memory by the loader's
    pinning thread, so the copy to a CUDA device runs asynchronously
    (``non_blocking``) while the device computes.

    Each worker keeps ``prefetch_factor`` (2) batches ready in shared memory:
    :func:`loader_shared_memory` says how much that is, and the trainer logs it.
    """
    position = start * world_size
    if domain_sampling == "balanced":
        dataset = source.dataset
        domains = [dataset.domain(i) for i in range(len(dataset))]
        order: EpochOrder = BalancedEpochOrder(
            domains, seed, start=position, rank=rank, world_size=world_size)
    elif domain_sampling == "natural":
        order = EpochOrder(len(source), seed, start=position, rank=rank, world_size=world_size)
    else:
        raise UserError(f"engine.domain_sampling must be one of {DOMAIN_SAMPLING}, got {domain_sampling!r}")
    if world_size > 1:
        logger.info(share_report(order, batch_size))
    return torch.utils.data.DataLoader(
        source,
        batch_size=batch_size,
        sampler=order,
        collate_fn=functools.partial(collate if views_to_device else collate_float_views,
                                     spec=source.transform.batch_spec(), share_views=True),
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=PREFETCH_BATCHES if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        drop_last=True,
    )


#: Batches each loader worker keeps ready (torch's default): the loader's shared memory is
#: workers x this x one batch (:func:`loader_shared_memory`).
PREFETCH_BATCHES = 2


def loader_shared_memory(num_workers: int, batch_bytes: int) -> int:
    """Shared memory the loader's ready batches hold at most: each worker's prefetched batches,
    plus one the training process still holds while the next arrives."""
    return (num_workers * PREFETCH_BATCHES + 1) * batch_bytes if num_workers > 0 else 0


def stating_shared_memory(loader: torch.utils.data.DataLoader) -> Iterator[dict[str, Any]]:
    """``loader``'s batches; at the first, a log line saying how much shared memory the ready
    batches hold (a warning where /dev/shm has less room: a worker would die with a bus error)."""
    batches = iter(loader)
    first = next(batches)
    batch_bytes = sum(t.numel() * t.element_size() for t in first["tensors"].values())
    held = loader_shared_memory(loader.num_workers, batch_bytes)
    if held:
        line = (f"data loader: {counted(loader.num_workers, 'worker')} x {PREFETCH_BATCHES} ready batches of "
                f"{format_bytes(batch_bytes)} hold up to {format_bytes(held)} of shared memory")
        try:
            room = shutil.disk_usage("/dev/shm").total
        except OSError:
            room = None
        if room is not None and held > room:
            logger.warning("%s, more than /dev/shm's %s: lower engine.num_workers or "
                           "engine.per_device_batch, or enlarge /dev/shm", line, format_bytes(room))
        else:
            logger.info(line)
    yield first
    yield from batches


#: At most this many workers when derived from the machine: beyond it a TPU host's 240 vCPUs
#: feed nothing more (docs/data-at-scale.md sizes a v4 host at about 5 cores at 40 % MFU).
MAX_AUTO_WORKERS = 8


def loader_workers(configured: int | None, device_kind: str) -> tuple[int, str]:
    """The loader workers of one training process, and why: ``engine.num_workers`` when the
    recipe pins it; else 0 on the cpu device, and on an accelerator the cores this process may
    use (its share of the host's, ``LOCAL_WORLD_SIZE`` processes) minus one for itself, at most 8."""
    if configured is not None:
        return configured, "engine.num_workers"
    if device_kind == "cpu":
        return 0, "auto: training on the CPU uses its cores"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    workers = max(0, min(MAX_AUTO_WORKERS, cores // processes - 1))
    return workers, f"auto: {counted(cores, 'core')} / {counted(processes, 'process', 'processes')} - 1"
