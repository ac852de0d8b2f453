"""``octfw prepare``: a recipe's dataset, prepared once into a location, on a Dask cluster.

The driver (this process) builds the recipe's dataset and transform, asks
every source's stamp (size and modification time, or the object store's
hash and generation: metadata only, in threads), and turns it into the
volume's key (:func:`~octfw.data.prepared_store.volume_key`). Keys that
already have a commit record under ``entries/`` are done; the others go to
the cluster as one task each (:func:`~octfw.data.prepared_store.prepare_volume`:
read, prepare, encode, write the array, then the entry). When every task
has finished, the driver writes ``index.jsonl`` and ``quarantine.jsonl``
from the entries, then the header with ``complete = true``, and only then
removes volumes the dataset no longer lists (files removed or rewritten).

So the work is idempotent and resumable: killed at any point, a rerun
redoes only volumes without an entry; run after files were added or
changed, it prepares only those. The cluster is a Dask ``LocalCluster`` of
``workers`` processes by default, or any running cluster (``--scheduler
tcp://host:8786``) whose workers can import octfw and read the sources.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import attrs

from octfw.data.prepared_store import (
    DTYPES, ENTRIES, HEADER_FILE, INDEX_FILE, QUARANTINE_FILE, VOLUMES, Header, join, options_difference,
    prepare_volume, read_header, volume_key, write_lines,
)
from octfw.errors import UserError
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.storage.files import open_filesystem, write_atomically

__all__ = ["PrepareSummary", "prepare_dataset"]

logger = logging.getLogger(__name__)

# Stamps are metadata requests: threads overlap their network latency.
_STAMP_THREADS = 16
Progress = Callable[[int, int], None]


@attrs.frozen
class PrepareSummary:
    location: str
    volumes: int  #: usable volumes in the index
    prepared: int  #: prepared by this run
    reused: int  #: already done (same source, same stamp)
    quarantined: int
    removed: int  #: volumes of sources no longer listed (or rewritten), deleted
    stored_bytes: int  #: compressed chunk bytes of all usable volumes
    seconds: float
    workers: int


def _stamp(url: str) -> str:
    """What changes when a file is rewritten, from its metadata only ('' when not a file)."""
    try:
        fs, path = open_filesystem(url)
        info = fs.info(path)
    except (OSError, UserError):
        return ""
    # gcsfs: md5Hash/crc32c and generation; local: size and mtime.
    keys = ("size", "mtime", "md5Hash", "crc32c", "generation", "etag")
    return json.dumps({k: str(info[k]) for k in keys if info.get(k) is not None}, sort_keys=True)


def _stamps(dataset: Any) -> list[tuple[tuple[str, ...], str]]:
    """(files, stamp) of every volume; a series' stamp covers all its files."""
    files_of = getattr(dataset, "files", None)
    files = [tuple(files_of(i)) if callable(files_of) else (dataset.source(i),) for i in range(len(dataset))]
    flat = sorted({url for group in files for url in group})
    with ThreadPoolExecutor(max_workers=_STAMP_THREADS) as pool:
        stamp_of = dict(zip(flat, pool.map(_stamp, flat)))
    return [(group, "\n".join(f"{u}={stamp_of[u]}" for u in sorted(group))) for group in files]


def _extra(dataset: Any, index: int) -> dict[str, Any]:
    """Label, split and patient: what the dataset knows of a volume without reading it."""
    extra = {}
    for name in ("label", "split", "patient"):
        method = getattr(dataset, name, None)
        extra[name] = method(index) if callable(method) else None
    return extra


def _done_entries(fs: Any, root: str, keys: set[str]) -> dict[str, dict[str, Any]]:
    """The commit records already written for ``keys``."""
    try:
        names = fs.ls(join(root, ENTRIES), detail=False)
    except FileNotFoundError:
        return {}
    wanted = [n for n in names if os.path.basename(n).removesuffix(".json") in keys]
    found = fs.cat(wanted) if wanted else {}
    entries = {}
    for name, data in found.items():
        try:
            entries[os.path.basename(name).removesuffix(".json")] = json.loads(data)
        except ValueError:
            continue  # a damaged record: the volume is prepared again
    return entries


def _start_client(scheduler: str | None, workers: int) -> tuple[Any, Any]:
    """(client, local cluster or None)."""
    from distributed import Client, LocalCluster

    if scheduler is not None:
        try:
            return Client(scheduler, timeout="20s"), None
        except (OSError, TimeoutError) as exc:
            raise UserError(f"--scheduler {scheduler}: cannot reach a Dask scheduler ({exc})") from None
    # Processes, one thread each: prepare is CPU-bound numpy/torch work that
    # holds the GIL in places; separate processes scale it with the cores.
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=logging.ERROR)
    return Client(cluster), cluster


def _run_tasks(client: Any, dataset: Any, transform: Any, location: str, dtype: str,
               todo: Sequence[tuple[int, str, tuple[str, ...]]], progress: Progress | None) -> Iterator[tuple[str, dict]]:
    """Prepare ``todo`` on the cluster; yields (key, entry) as tasks finish."""
    from distributed import as_completed

    # Sent once to every worker, not pickled into each of thousands of tasks.
    dataset_future, transform_future = client.scatter([dataset, transform], broadcast=True, hash=False)
    futures = {}
    for index, key, files in todo:
        future = client.submit(prepare_volume, dataset_future, transform_future, index, location, key, dtype,
                               files, _extra(dataset, index), key=f"octfw-prepare-{key}", pure=False)
        futures[future] = (index, key)
    done = 0
    try:
        for future in as_completed(futures):
            index, key = futures[future]
            if future.status == "error":
                error = future.exception()
                raise UserError(f"preparing {dataset.source(index)} failed: {type(error).__name__}: {error} "
                                "(volumes done so far are kept; run `octfw prepare` again to continue)")
            done += 1
            if progress is not None:
                progress(done, len(todo))
            yield key, future.result()
    finally:
        client.cancel(list(futures))


def prepare_dataset(recipe: Recipe, registry: Registry, location: str, *, scheduler: str | None = None,
                    workers: int | None = None, dtype: str = "auto",
                    progress: Progress | None = None, report: Callable[[str], None] = print) -> PrepareSummary:
    """Prepare the recipe's dataset into ``location``; see the module docstring."""
    started = time.perf_counter()
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    location = str(location).rstrip("/")
    ctx = recipe.build_context(registry=registry)
    dataset = recipe.dataset.build(ctx)
    transform = recipe.transform.build(ctx)
    if not (callable(getattr(transform, "prepare", None)) and callable(getattr(transform, "prepare_options", None))):
        raise UserError(f"transform {recipe.transform.name!r} has no deterministic prepare() half to store")
    if not callable(getattr(dataset, "source", None)):
        raise UserError(f"dataset {recipe.dataset.name!r} does not name its sources (source(i)); it cannot be prepared")
    if getattr(dataset, "prepared_key", None) is not None:
        raise UserError(f"dataset {recipe.dataset.name!r} is prepared already")
    transform.cache = None  # the prepared location is the cache; never fill the local one
    options = transform.prepare_options()

    fs, root = open_filesystem(location, setting="--out")
    previous = read_header(location, must_be_complete=False)
    if previous is not None:
        differences = options_difference(previous.transform, options)
        if differences:
            raise UserError(f"--out {location} holds volumes prepared with other transform options: "
                            f"{'; '.join(differences)}. Prepare into a new location")
    header = Header(transform=options, transform_key=transform.cache_key(),
                    image_size=tuple(transform.image_size), dtype=dtype)
    try:  # marks the location partly written (and checks that it can be written) before any work
        write_atomically(join(location, HEADER_FILE), header.to_bytes())
    except PermissionError as exc:
        raise UserError(f"--out {location}: no permission to write ({exc})") from None
    except OSError as exc:
        raise UserError(f"--out {location}: cannot write ({type(exc).__name__}: {exc})") from None

    report(f"prepare   {len(dataset)} volumes of {dataset!r} -> {location}")
    stamps = _stamps(dataset)
    plan = [(i, volume_key(dataset.source(i), stamp), files) for i, (files, stamp) in enumerate(stamps)]
    keys = {key for _i, key, _f in plan}
    entries = _done_entries(fs, root, keys)
    todo = [(i, key, files) for i, key, files in plan if key not in entries]
    reused = len(plan) - len(todo)
    used_workers = 0
    if todo:
        workers = workers or os.cpu_count() or 1
        client, cluster = _start_client(scheduler, workers)
        try:
            used_workers = len(client.scheduler_info()["workers"])
            report(f"prepare   {len(todo)} to prepare, {reused} done already; "
                   f"{used_workers} Dask workers ({scheduler or 'local cluster'})")
            for key, entry in _run_tasks(client, dataset, transform, location, dtype, todo, progress):
                entries[key] = entry
        finally:
            client.close()
            if cluster is not None:
                cluster.close()

    rows = [entries[key]["row"] for _i, key, _f in plan if "row" in entries[key]]
    quarantined = [entries[key]["quarantined"] for _i, key, _f in plan if "quarantined" in entries[key]]
    index_bytes = write_lines(location, INDEX_FILE, rows)
    write_lines(location, QUARANTINE_FILE, quarantined)
    header = attrs.evolve(header, complete=True, volumes=len(rows), quarantined=len(quarantined),
                          index_sha256=hashlib.sha256(index_bytes).hexdigest())
    write_atomically(join(location, HEADER_FILE), header.to_bytes())
    removed = _remove_stale(fs, root, keys)
    return PrepareSummary(location=location, volumes=len(rows), prepared=len(todo), reused=reused,
                          quarantined=len(quarantined), removed=removed,
                          stored_bytes=sum(int(r["nbytes"]) for r in rows),
                          seconds=time.perf_counter() - started, workers=used_workers)


def _remove_stale(fs: Any, root: str, keys: set[str]) -> int:
    """Delete volumes and entries whose key the dataset no longer has (after the new index is written)."""
    stale = []
    for folder, suffix in ((VOLUMES, ""), (ENTRIES, ".json")):
        try:
            names = fs.ls(join(root, folder), detail=False)
        except FileNotFoundError:
            continue
        stale += [n for n in names if os.path.basename(n.rstrip("/")).removesuffix(suffix) not in keys]
    for name in stale:
        fs.rm(name, recursive=True)
    return sum(1 for n in stale if f"/{ENTRIES}/" in n)
