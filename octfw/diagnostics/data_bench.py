"""``octfw bench RECIPE --data-only``: the data loader alone, and the workers a host needs.

An input host of a TPU pod is sized by one number: how many samples per
second one loader worker delivers on the recipe's data (read, decode or
check, prepare, views and masks, collate). This builds only the recipe's
dataset and transform, runs the engine's own loader (``SampleSource`` and
``make_loader``, batches of ``engine.per_device_batch``) with 0, 1, 2, ...
workers, times ``samples`` samples after the first batch (worker start-up
and imports are not the steady state) and samples the resident memory of the
worker processes (memory unique to each: a forked worker shares the rest
with the training process). From the rate per worker and a device rate the user states
(samples per second one device consumes: ``octfw bench`` without
``--data-only`` measures it), it says how many workers feed the recipe's
devices.

A transform with a per-host prepared-volume cache (``oct-standard``) fills
it on the first pass over the data, and later epochs read it. A cold cache
is filled first, with the most workers asked for (that pass is timed and
reported), so every worker count is measured in the state training spends
its epochs in.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Sequence

import attrs

from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.display.tables import counted, render_table
from octfw.types import TransformCheckingDataset

__all__ = ["LoaderRate", "measure_loader", "workers_needed", "format_data_bench"]


@attrs.frozen
class LoaderRate:
    workers: int
    samples: int
    seconds: float
    #: bytes of memory unique to the largest worker process (USS: what it costs beyond the pages
    #: it shares with the training process it was forked from); None without workers
    peak_worker_uss: int | None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def per_worker(self) -> float:
        """Samples/s per loading process (the training process itself with 0 workers)."""
        return self.samples_per_s / max(1, self.workers)


class _PeakChildMemory:
    """The largest unique set size of any child process, sampled every 50 ms in a thread."""

    def __init__(self) -> None:
        import psutil

        self._process, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._lock = threading.Lock()  # sample() runs in the watcher and, last, in the caller
        self._thread = threading.Thread(target=self._watch, name="octfw-bench-memory", daemon=True)

    def sample(self) -> None:
        import psutil

        for child in self._process.children(recursive=True):
            try:
                unique = child.memory_full_info().uss
            except psutil.Error:  # a worker that has just exited
                continue
            with self._lock:
                self.peak = max(self.peak, unique)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.05)

    def __enter__(self) -> "_PeakChildMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def measure_loader(recipe: Recipe, registry: Registry, workers: Sequence[int], samples: int,
                   progress: Callable[[int, int, str], None] | None = None) -> tuple[list[LoaderRate], str]:
    """One :class:`LoaderRate` per worker count, on the recipe's dataset and transform, and the
    state of the transform's prepared-volume cache before the first pass, in words."""
    from octfw.engine.data import SampleSource, make_loader  # imports torch: only when measuring

    ctx = recipe.build_context(registry=registry, writable_cache=True)
    dataset = recipe.dataset.build(ctx)
    transform = recipe.transform.build(ctx)
    if isinstance(dataset, TransformCheckingDataset):
        dataset.check_transform(transform)
    source = SampleSource(dataset, transform, recipe.run.seed)
    cache = _cache_state(source)
    batch = recipe.engine.per_device_batch
    if cache.startswith("cold"):
        # Later epochs read the cache: fill it first (the first epoch's work, timed and said), so
        # every worker count is measured in the same, steady state.
        if progress is not None:
            progress(0, len(workers), f"first pass: preparing {counted(len(dataset), 'volume')} into the cache")
        filled = _timed(make_loader(source, batch, recipe.run.seed, start=0, num_workers=max(workers)),
                        len(dataset) // batch * batch or batch, batch, skip_first=False)
        cache += (f"; the first pass prepared them at {filled[0] / filled[1]:.3g} samples/s with "
                  f"{counted(max(workers), 'worker')}, the rates above are of later epochs")
    rates = []
    for done_counts, count in enumerate(workers):
        if progress is not None:
            progress(done_counts, len(workers), f"{counted(count, 'worker')}")
        with _PeakChildMemory() as memory:
            loaded, seconds = _timed(make_loader(source, batch, recipe.run.seed, start=0, num_workers=count),
                                     samples, batch, before_end=memory.sample)
        rates.append(LoaderRate(count, loaded, seconds, memory.peak if count else None))
    return rates, cache


def _timed(loader: Any, samples: int, batch: int, skip_first: bool = True,
           before_end: Callable[[], None] | None = None) -> tuple[int, float]:
    """(samples loaded, seconds): at least ``samples``, after the first batch unless told
    otherwise (worker start-up, imports, first reads are not the steady state).
    ``before_end`` runs while the workers still live (a last memory sample)."""
    batches = iter(loader)
    if skip_first:
        next(batches)
    started, loaded = time.perf_counter(), 0
    while loaded < samples:
        next(batches)
        loaded += batch
    seconds = time.perf_counter() - started
    if before_end is not None:
        before_end()
    del batches  # persistent workers end with their iterator
    return loaded, seconds


def _cache_state(source: Any) -> str:
    if source.cache is None:
        return "none (every sample is read as the dataset stores it)"
    dataset = source.dataset
    cached = sum(source.cache.path(dataset.source(i)).exists() for i in range(len(dataset)))
    if cached == len(dataset):
        return f"warm: all {counted(len(dataset), 'volume')} prepared in {source.cache.folder}"
    return f"cold: {cached} of {counted(len(dataset), 'volume')} were prepared in {source.cache.folder}"


def workers_needed(rate: LoaderRate, device_rate: float, devices: int) -> int:
    """Loader workers that deliver ``devices x device_rate`` samples/s at ``rate``'s per-worker rate."""
    return max(1, math.ceil(devices * device_rate / rate.per_worker))


def format_data_bench(rates: Sequence[LoaderRate], *, device_rate: float | None, devices: int,
                      cache: str) -> str:
    table = render_table(
        ["workers", "samples/s", "per worker", "peak memory per worker"],
        [[str(r.workers), f"{r.samples_per_s:.3g}", f"{r.per_worker:.3g}",
          "-" if r.peak_worker_uss is None else f"{r.peak_worker_uss / 2**20:,.0f} MiB"] for r in rates],
        right=(0, 1, 2, 3))
    lines = [table, "", f"transform cache: {cache}"]
    with_workers = [r for r in rates if r.workers > 0] or list(rates)
    best = max(with_workers, key=lambda r: r.per_worker)
    if device_rate is not None:
        need = workers_needed(best, device_rate, devices)
        lines.append(f"at {device_rate:g} samples/s per device x {counted(devices, 'device')}: "
                     f"{counted(need, 'loader worker')} ({best.per_worker:.3g} samples/s each, "
                     f"measured with {best.workers}) and as many free cores; set engine.num_workers = {need} "
                     "per training process")
    else:
        lines.append("give --device-rate SAMPLES_PER_S (what one device consumes; `octfw bench` measures it) "
                     "to get the workers your devices need")
    return "\n".join(lines)
