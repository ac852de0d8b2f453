"""From dataset to batches: epoch-seeded order, per-sample RNG, quarantine, collate.

Every sample's randomness comes from ``(seed, epoch, index)``, so a batch does
not depend on worker count or timing and can be rebuilt later. A file the
dataset cannot use is quarantined and replaced by the next usable sample in
the same epoch order; no good file is dropped, and training never stops for
one bad file. Rank 0 warns once per quarantined file (logger
``octfw.engine.data``) and lists it in ``quarantine.jsonl``.

Prepared volumes are cached: when the transform has a deterministic
``prepare`` half with a ``cache`` (:class:`octfw.types.PreparingTransform`)
and the dataset names each volume's ``source`` without I/O
(:class:`octfw.types.SourcedDataset`), a cached volume skips reading and
decoding its file entirely; only the random half (views, masks) runs.

Domains: ``natural`` order draws every file once per epoch; ``balanced``
draws the same number of samples from every domain each epoch
(:class:`BalancedEpochOrder`), repeating files of small domains and
spreading those of large ones over epochs.

Several processes (the hosts of a TPU slice, or torchrun ranks) share one
stream of samples: process ``r`` of ``W`` takes every ``W``-th position from
``r`` on, so together they draw each epoch exactly once and a step's global
batch holds the same samples whatever ``W`` is (:class:`EpochOrder`).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from octfw.display.errors import ContractError, CorruptFile, UserError
from octfw.types import (DOMAIN_ID_KEY, UINT8_SCALE, BatchKey, Dataset, DomainCountingDataset,
                         PreparedVolumesDataset, PreparingTransform, Provenance, SeriesDataset, SourcedDataset,
                         STORED_VIEW_DTYPES, Transform, dequantize)
from octfw.storage.failures import format_bytes
from octfw.display.tables import counted

__all__ = [
    "DOMAIN_SAMPLING",
    "EpochOrder",
    "BalancedEpochOrder",
    "SampleSource",
    "collate",
    "make_loader",
    "share_report",
    "Quarantine",
    "dataset_domains",
    "domain_counts",
    "domain_report",
    "listed",
]

logger = logging.getLogger(__name__)

#: Values of ``[engine] domain_sampling``.
DOMAIN_SAMPLING = ("natural", "balanced")


class EpochOrder(torch.utils.data.Sampler):
    """An endless stream of ``(epoch, index)``: a fresh permutation per epoch.

    Position ``p`` of the stream is sample ``p % N`` of epoch ``p // N``'s
    order: epochs follow each other with nothing dropped, so a batch may
    straddle two epochs. ``start`` is the stream position to begin at (the
    samples all processes have consumed), so a resumed run continues exactly
    where the checkpoint left off.

    With several processes, process ``rank`` takes positions ``start + rank``,
    ``start + rank + world_size``, ...: over ``k`` samples each, the processes
    together take exactly the positions ``start .. start + k * world_size``,
    the same samples one process would take alone. So every epoch is drawn
    exactly once in total, and which samples form a step's global batch does
    not depend on how many processes load it.
    """

    def __init__(self, size: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1):
        self.size, self.seed, self.start = size, seed, start
        self.rank, self.world_size = rank, world_size
        self._epochs: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch``, in the order they are drawn."""
        if epoch not in self._epochs:
            self._epochs = {epoch: self._order(epoch)}  # one epoch at a time is all a stream needs
        return self._epochs[epoch]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = self.start + self.rank
        while True:
            epoch, offset = divmod(position, self.size)
            yield epoch, int(self.epoch_order(epoch)[offset])
            position += self.world_size


class BalancedEpochOrder(EpochOrder):
    """Like :class:`EpochOrder`, but every domain gets an equal share of each epoch.

    An epoch keeps the dataset's length ``N`` (so steps per epoch do not
    change). Each of the ``K`` domains gets ``N // K`` draws; the ``N % K``
    left over go to domains chosen at random per epoch. A domain's draws walk
    through its files in a fresh permutation per pass, continuing across
    epochs, so a large domain is covered over several epochs without
    repeats and a small one repeats evenly. Everything is a function of
    ``(seed, epoch)``, so every process computes the same epoch order;
    positions, ``start``, ``rank`` and ``world_size`` work exactly as in
    :class:`EpochOrder`, and the processes together draw each epoch's
    balanced order exactly once.
    """

    def __init__(self, domains: list[str], seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1):
        if not domains:
            raise UserError("balanced domain sampling needs a non-empty dataset")
        super().__init__(len(domains), seed, start=start, rank=rank, world_size=world_size)
        names = sorted(set(domains))
        self.members = [np.array([i for i, d in enumerate(domains) if d == name]) for name in names]

    def _counts(self, epoch: int) -> np.ndarray:
        k = len(self.members)
        counts = np.full(k, self.size // k)
        extra = np.random.default_rng([self.seed, epoch, 1]).permutation(k)[: self.size % k]
        counts[extra] += 1
        return counts

    def _draws(self, domain: int, first: int, count: int) -> list[int]:
        """Draws ``first .. first + count`` of one domain's endless stream of passes."""
        members = self.members[domain]
        out: list[int] = []
        position = first
        while len(out) < count:
            passes, offset = divmod(position, len(members))
            order = np.random.default_rng([self.seed, domain, passes, 2]).permutation(len(members))
            take = min(len(members) - offset, count - len(out))
            out.extend(int(i) for i in members[order[offset:offset + take]])
            position += take
        return out

    def _order(self, epoch: int) -> np.ndarray:
        consumed = np.zeros(len(self.members), dtype=np.int64)
        for earlier in range(epoch):
            consumed += self._counts(earlier)
        counts = self._counts(epoch)
        chosen = [i for d in range(len(self.members))
                  for i in self._draws(d, int(consumed[d]), int(counts[d]))]
        return np.array(chosen)[np.random.default_rng([self.seed, epoch, 3]).permutation(self.size)]


class SampleSource(torch.utils.data.Dataset):
    """Loads and transforms one ``(epoch, index)``; quarantines unusable files.

    With a caching transform and a dataset that names its sources, a
    prepared volume is read from the transform's cache; see the module
    docstring. A file found unusable is remembered (per process) so later
    epochs skip it without reading it again; it is still reported each time,
    and :class:`Quarantine` records it once.
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


def view_keys(spec: Mapping[str, BatchKey]) -> tuple[str, ...]:
    """The keys of a batch specification that are views (images the model reads as float32)."""
    return tuple(key for key, field in spec.items() if field.view)


_STORED_TORCH_DTYPES = tuple(getattr(torch, name) for name in STORED_VIEW_DTYPES)


def float_views(tensors: Mapping[str, Any], views: tuple[str, ...]) -> dict[str, Any]:
    """The batch with its ``views`` that travel as stored (uint8 ``b / 255`` or float16,
    :data:`~octfw.types.STORED_VIEW_DTYPES`) as float32 intensities, converted where they are
    (on the device, after the transfer): the one place a stored view becomes model input,
    bit for bit what :func:`~octfw.types.dequantize` gives on the host."""
    out = dict(tensors)
    for key in views:
        view = out.get(key)
        if isinstance(view, torch.Tensor) and view.dtype in _STORED_TORCH_DTYPES:
            if view.device.type == "cpu":  # numpy's cast is 3x torch's on the host, and bitwise the same
                out[key] = torch.from_numpy(dequantize(view.numpy()))
            elif view.dtype == torch.uint8:
                out[key] = view.to(torch.float32).mul_(UINT8_SCALE)
            else:  # float16 -> float32 is exact
                out[key] = view.to(torch.float32)
        elif isinstance(view, np.ndarray) and view.dtype.name in STORED_VIEW_DTYPES:
            out[key] = dequantize(view)
    return out


def shared_views(arrays: Mapping[str, Any], views: tuple[str, ...]) -> dict[str, str]:
    """Each view that is the same array as an earlier view of the sample (nothing augmented
    it) -> that earlier view."""
    aliases: dict[str, str] = {}
    for i, key in enumerate(views):
        source = next((earlier for earlier in views[:i] if earlier not in aliases
                       and _same_array(arrays.get(earlier), arrays.get(key))), None)
        if source is not None:
            aliases[key] = source
    return aliases


def collate_float_views(items: list[dict[str, Any]], spec: Mapping[str, BatchKey],
                        share_views: bool = False) -> dict[str, Any]:
    """:func:`collate`, with stored (uint8, float16) views converted to float32 in the loader (for the cpu
    device, where the training process has no device to do it on). Each sample's views are
    converted before the stacking, so in a worker the float32 batch is stacked straight into
    shared memory, not converted afterwards and copied there."""
    views = view_keys(spec)
    converted = []
    for item in items:
        arrays = item["arrays"]
        floats = float_views(arrays, views)
        if share_views:  # converted once, still one volume
            floats.update({key: floats[source] for key, source in shared_views(arrays, views).items()})
        converted.append({**item, "arrays": floats})
    return collate(converted, spec, share_views)


def collate(items: list[dict[str, Any]], spec: Mapping[str, BatchKey], share_views: bool = False) -> dict[str, Any]:
    """Stack each declared key's arrays into a batch tensor; keep provenance and quarantine
    records on the host. A key the transform returns but does not declare, a declared key it
    does not return, or an array of another shape than declared is a :class:`ContractError`:
    nothing is dropped or reshaped silently.

    ``share_views``: where every sample's view is the same array as an earlier view (nothing
    augments them), the batch carries the volume once: ``tensors`` lacks the later view and
    ``aliases`` maps it to the earlier, restored after the transfer to the device
    (:func:`with_aliases`). Half the shared memory, pinned memory and copy bytes."""
    for item in items:
        _check_declared(item["arrays"], spec)
    aliases = shared_views(items[0]["arrays"], view_keys(spec)) if share_views else {}
    aliases = {key: source for key, source in aliases.items()
               if all(_same_array(item["arrays"][source], item["arrays"][key]) for item in items)}
    tensors = {}
    for key in (*spec, DOMAIN_ID_KEY):
        if key in aliases:
            continue
        arrays = [np.asarray(item["arrays"][key]) for item in items]
        declared = spec[key].shape if key in spec else ()
        wrong = next((a.shape for a in arrays if a.shape != tuple(declared)), None)
        if wrong is not None:
            raise ContractError(f"transform output {key!r} has shape {list(wrong)} per sample; "
                                f"its batch_spec declares {list(declared)}")
        tensors[key] = _stack(arrays)
    return {
        "tensors": tensors,
        "aliases": aliases,
        "provenance": [item["provenance"] for item in items],
        "quarantined": [q for item in items for q in item["quarantined"]],
    }


def _check_declared(arrays: Mapping[str, Any], spec: Mapping[str, BatchKey]) -> None:
    returned = set(arrays) - {DOMAIN_ID_KEY}
    if returned != set(spec):
        extra, missing = sorted(returned - set(spec)), sorted(set(spec) - returned)
        raise ContractError("transform output does not match its batch_spec: "
                            + "; ".join(([f"returns undeclared {', '.join(map(repr, extra))}"] if extra else [])
                                        + ([f"lacks declared {', '.join(map(repr, missing))}"] if missing else [])))


def with_aliases(tensors: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """The batch's tensors with each aliased key pointing at the tensor it shares (see :func:`collate`)."""
    return {**tensors, **{key: tensors[source] for key, source in aliases.items()}}


def _same_array(a: Any, b: Any) -> bool:
    """Whether two arrays are views of the same memory with the same layout (the same volume)."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        return False
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)


def _stack(arrays: list[np.ndarray]) -> torch.Tensor:
    """One batch tensor. In a loader worker it is made in shared memory, as torch's
    ``default_collate`` makes it: the batch then reaches the training process without being
    copied into shared memory again (a batch of views at the seeds' size is 300 MB)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.from_numpy(np.stack(arrays))  # numpy's allocator: huge pages, fewer faults
    dtype = torch.from_numpy(np.empty(0, arrays[0].dtype)).dtype
    shape = (len(arrays), *arrays[0].shape)
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))
    out = torch.empty(0, dtype=dtype).new(storage).view(shape)
    np.stack(arrays, out=out.numpy())
    return out


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


def share_report(order: EpochOrder, batch_size: int, shown: int = 4) -> str:
    """One line on what this process loads, e.g. ``host 1 of 4 loads 4 samples per
    micro-step: offsets 1, 5, 9, 13 of each global micro-batch of 16 stream positions,
    from position 0 (epoch 0); first dataset indices 12, 40, 3, 27``. Hosts that read
    different data show different first indices; they are computed, not loaded."""
    stride = order.world_size
    offsets = ", ".join(str(order.rank + stride * j) for j in range(min(batch_size, shown)))
    more = ", ..." if batch_size > shown else ""
    first = [index for _, index in itertools.islice(iter(order), shown)]
    return (f"host {order.rank} of {stride} loads {counted(batch_size, 'sample')} per micro-step: offsets "
            f"{offsets}{more} of each global micro-batch of {batch_size * stride} stream positions, "
            f"from position {order.start} (epoch {order.start // order.size}); first dataset "
            "indices " + ", ".join(map(str, first)))


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


def provenance_record(provenance: Provenance) -> dict[str, Any]:
    return {"source": provenance.source, "domain": provenance.domain}


def dataset_domains(dataset: Dataset) -> list[str]:
    """The dataset's domain names, sorted: position i is domain id i."""
    return sorted(domain_counts(dataset))


def domain_counts(dataset: Dataset) -> dict[str, int]:
    """Files (dataset entries) per domain, sorted by domain name (without decoding pixels)."""
    if isinstance(dataset, DomainCountingDataset):
        return dict(dataset.domain_counts())
    counts: dict[str, int] = {}
    for index in range(len(dataset)):
        domain = dataset.domain(index)
        counts[domain] = counts.get(domain, 0) + 1
    return dict(sorted(counts.items()))


def listed(dataset: Dataset) -> str:
    """What a dataset lists, before any file is read: ``48 files``, or ``40 files and
    8 series`` (of single-frame files). Files, not samples or volumes: which of them
    hold a usable volume is known only once they are read (others are quarantined)."""
    series = sum(1 for i in range(len(dataset)) if dataset.is_series(i)) if isinstance(dataset, SeriesDataset) else 0
    files = len(dataset) - series
    text = f"{files} file{'' if files == 1 else 's'}"
    return f"{text} and {series} series" if series else text


def domain_report(dataset: Dataset, domain_sampling: str = "natural") -> str:
    """One line for the start of a run: files per domain, and how they are drawn.

    For example ``dataset: 48 files in 3 domains: heidelberg 16, topcon 16,
    zeiss 16 (natural sampling)``.
    """
    counts = domain_counts(dataset)
    noun = "domain" if len(counts) == 1 else "domains"
    per_domain = ", ".join(f"{domain} {count}" for domain, count in counts.items())
    return (f"dataset: {listed(dataset)} in {len(counts)} {noun}: {per_domain} "
            f"({domain_sampling} sampling)")
