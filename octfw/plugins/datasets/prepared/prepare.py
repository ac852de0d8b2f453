"""``octfw prepare``: a recipe's dataset, prepared once into a location, on a Dask cluster.

The driver (this process) builds the recipe's dataset and transform, asks
every source's stamp (size and modification time, or the object store's
hash and generation: metadata only, in threads), and turns it into the
volume's key (:func:`~octfw.plugins.datasets.prepared.store.volume_key`). Keys that
already have a commit record under ``entries/`` are done; the others go to
the cluster as one task each (:func:`~octfw.plugins.datasets.prepared.store.prepare_volume`:
read, prepare, encode, write the array, then the entry).

So the work is idempotent and resumable: killed at any point, a rerun
redoes only volumes without an entry; run after files were added or
changed, it prepares only those. The cluster is a Dask ``LocalCluster`` of
``workers`` processes by default, or any running cluster (``--scheduler
tcp://host:8786``) whose workers can import octfw and read the sources.

A prepare never damages what a location holds:

- **Snapshots.** When every task has finished, the driver writes the new
  index and quarantine under names that are their content's hash, then the
  header that names them, in one atomic write. Readers (the ``prepared``
  dataset) read the header and the index it names, so they see the last
  complete snapshot until that write and the new one after it. The header
  of a location that has a complete snapshot is never rewritten before the
  end (``complete = false`` only marks a location whose first prepare has
  not finished).
- **Which dataset.** The header records the recipe ``[dataset]`` tables
  (name and every option, paths resolved) prepared into the location. A
  recipe whose table is recorded updates its own volumes, incrementally; a
  recipe with another table, or other transform options, is refused unless
  ``add`` (merge its volumes in; same transform options) or ``replace``
  (rebuild the location for this recipe alone) says what to do. A store
  written before tables were recorded counts as the same dataset when it
  lists at least one of the recipe's sources.
- **Removal only when asked.** Volumes the new snapshot no longer lists
  (sources removed or rewritten, other datasets after ``replace``) are
  deleted only with ``prune`` (implied by ``replace``), only after the new
  header is written, and their sources are reported. Without it they stay,
  so a trainer that opened the previous snapshot keeps reading, and the
  summary counts them as stale.
- **One prepare at a time.** ``prepare.lock`` in the location: for a local
  folder an OS lock (``fcntl.flock``, released by the OS when its process
  dies, however it dies) plus the owner's host, pid and start time; for an
  object store an owner object, created only if absent (``ifGenerationMatch=0``
  on GCS), read back, and renewed every few minutes as a lease. A second
  prepare is refused with the owner named; an owner that died (a pid gone
  on this host, or a lease not renewed for :data:`LEASE_S`) is taken over
  with a warning. :class:`octfw.storage.owner.FolderOwner` does this, as
  for run and checkpoint folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs

from octfw.plugins.datasets.prepared.store import (
    DTYPES, ENTRIES, HEADER_FILE, INDEX_FILE, LAYERS, LOCK_FILE, QUARANTINE_FILE, VOLUMES, Header, IndexRow,
    dataset_id, encode_lines, join, options_difference, prepare_volume, read_header, read_index,
    snapshot_name, volume_key,
)
from octfw.display.errors import UserError
from octfw.cli.exit_codes import SAVE_FAILED_EXIT_CODE
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.storage.failures import storage_cause
from octfw.storage.files import open_filesystem, write_atomically
from octfw.storage.owner import FolderOwner
from octfw.display.tables import counted
from octfw.types import LayeredDataset, PreparedVolumesDataset, SourcedDataset, StorableTransform

__all__ = ["PrepareSummary", "prepare_dataset", "check_out", "LEASE_S"]

logger = logging.getLogger(__name__)

# Stamps are metadata requests: threads overlap their network latency.
_STAMP_THREADS = 16
#: An object-store lock not renewed for this long belongs to a prepare that died.
LEASE_S = 600.0
Progress = Callable[[int, int], None]


@attrs.frozen
class PrepareSummary:
    location: str
    volumes: int  #: usable volumes in the new snapshot's index
    prepared: int  #: prepared by this run
    reused: int  #: already done (same source, same stamp)
    quarantined: int
    removed: int  #: volumes deleted after the new snapshot was written (prune / replace)
    stored_bytes: int  #: compressed chunk bytes of all usable volumes
    seconds: float
    workers: int
    stale: int = 0  #: volumes the snapshot no longer lists, kept (``prune`` removes them)
    removed_sources: tuple[str, ...] = ()  #: the sources of the removed volumes
    kept: int = 0  #: volumes of other datasets in the index (merged with ``add``)
    quarantine_file: str = ""  #: URL of the snapshot's quarantine file


# --- --out and --scheduler ------------------------------------------------------


def check_out(location: str) -> str:
    """``--out`` checked by the rules of a recipe's locations, a relative path made absolute.

    "", whitespace, "None" and "null" (or a URL whose bucket is one) are refused:
    ``--out ""`` once prepared into the current folder, ``--out None`` into a folder named None.
    """
    from octfw.recipe.fields import Location
    from octfw.recipe.structuring import converter

    text = str(location)
    try:
        # file:// is Location's own way of naming a local path: checked as that path.
        checked = converter().structure(Location(text).local_path if text.startswith("file://") else text,
                                        Location)
    except ValueError:
        raise UserError(f"--out {text!r} is not a location: give a local folder or a URL such as "
                        "gs://bucket/prefix") from None
    return str(checked).rstrip("/")


def _check_scheduler(scheduler: str) -> None:
    from distributed.comm.addressing import get_address_host_port

    try:
        get_address_host_port(scheduler)
    except ValueError as exc:
        raise UserError(f"--scheduler {scheduler!r} is not a Dask scheduler address ({exc}); "
                        "write it like tcp://host:8786") from None


# --- library logs -------------------------------------------------------------------


@contextlib.contextmanager
def _library_log(cache_dir: Any, location: str) -> Iterator[None]:
    """gcsfs, aiohttp and fsspec records (retries, tracebacks) into a file, not onto the console:
    ``<cache_dir>/prepare-logs/<hash of the location>/octfw.log``."""
    from pathlib import Path

    from octfw.display.logs import attach_run_log, detach_run_log

    folder = Path(cache_dir) / "prepare-logs" / hashlib.sha256(location.encode("utf-8")).hexdigest()[:16]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handler = attach_run_log(folder)
    except OSError:
        handler = None  # no log file: the prepare itself does not need one
    try:
        yield
    finally:
        if handler is not None:
            detach_run_log(handler)


# --- what is in the store, and what this recipe makes of it ------------------------


def _describe_dataset(table: Mapping[str, Any]) -> str:
    where = next((str(table[k]) for k in ("path", "folder") if table.get(k)), None)
    return f"{table.get('name')} {where}" if where else str(table.get("name"))


def _read_quarantine(fs: Any, root: str, header: Header) -> list[dict[str, Any]]:
    try:
        text = fs.cat_file(join(root, header.quarantine)).decode("utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return []
    records = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            records.append(dict(json.loads(line)))
    return records


@attrs.frozen
class _Plan:
    """What this run does to the store, decided before any work."""

    salt: str  #: the key salt of the new snapshot
    datasets: tuple[Mapping[str, Any], ...]  #: recorded in the new header
    kept_rows: tuple[IndexRow, ...]  #: rows of the previous snapshot the new one keeps
    kept_quarantine: tuple[Mapping[str, Any], ...]
    prune: bool
    note: str  #: what happens to the store, for the report


def _plan(location: str, fs: Any, root: str, previous: Header | None, options: Mapping[str, Any],
          table: Mapping[str, Any], sources: set[str], *, add: bool, replace: bool, prune: bool) -> _Plan:
    this = dataset_id(table)
    mine = _describe_dataset(table)
    if previous is None:
        return _Plan("", (table,), (), (), prune, "")
    differences = options_difference(previous.transform, options)
    if differences:
        if not replace:
            raise UserError(f"--out {location} holds volumes prepared with other transform options: "
                            f"{'; '.join(differences)}. --replace rebuilds it with this recipe's options "
                            "(its volumes are removed once the new ones are in place); or prepare into a "
                            "new location")
        # New keys: the new volumes never overwrite the ones readers of the old snapshot read.
        salt = hashlib.sha256(json.dumps(dict(options), sort_keys=True, default=str).encode()).hexdigest()[:16]
        return _Plan(salt, (table,), (), (), True,
                     f" (replacing its {counted(previous.volumes, 'volume')} of other transform options)")
    rows: list[IndexRow] | None = []
    quarantine: list[dict[str, Any]] = []
    if previous.complete:
        try:
            rows = read_index(location, previous)
        except UserError:
            rows = None  # unreadable: fine when nothing of it is kept
        quarantine = _read_quarantine(fs, root, previous)
    legacy = not previous.datasets
    if legacy:  # written before datasets were recorded: the same dataset when it lists one of our sources
        listed = {r.source for r in rows or ()} | {str(q.get("source")) for q in quarantine}
        same = rows is None or not listed or bool(listed & sources)
    else:
        same = this in {dataset_id(d) for d in previous.datasets}
    others = ", ".join(_describe_dataset(d) for d in previous.datasets) or "an earlier recipe's dataset"
    if replace:
        return _Plan(previous.key_salt, (table,), (), (), True,
                     f" (replacing its {counted(previous.volumes, 'volume')} of {others})")
    if not same and not add:
        raise UserError(f"--out {location} holds another dataset ({others}; {counted(previous.volumes, 'volume')}) than "
                        f"this recipe's ({mine}). --add adds this recipe's volumes to it, --replace rebuilds "
                        "it for this recipe alone (removing the volumes not in it); or prepare into a new "
                        "location")
    owned = {this} | ({""} if legacy and same else set())
    if rows is None:
        if not same or len(previous.datasets) > 1:
            raise UserError(f"--out {location}: its current index cannot be read, so the volumes of "
                            f"{others} cannot be kept; --replace rebuilds it for this recipe alone")
        rows = []
    kept_rows = tuple(r for r in rows if r.dataset not in owned and r.source not in sources)
    kept_quarantine = tuple(q for q in quarantine if str(q.get("dataset", "")) not in owned
                            and q.get("source") not in sources)
    if same:
        datasets = (table,) if legacy else previous.datasets
        note = ""
    else:
        datasets = (*previous.datasets, table)
        note = f" (adding them to its {counted(previous.volumes, 'volume')} of {others})"
    return _Plan(previous.key_salt, datasets, kept_rows, kept_quarantine, prune, note)


# --- the work -----------------------------------------------------------------------


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
    # A volume's layer label file is stamped with it (a rewritten label file is a new key),
    # though only the volume's own files are hashed as its content.
    layers = [dataset.layers_source(i) if isinstance(dataset, LayeredDataset) else None for i in range(len(dataset))]
    stamped = [group + ((label_file,) if label_file is not None else ()) for group, label_file in zip(files, layers)]
    flat = sorted({url for group in stamped for url in group})
    with ThreadPoolExecutor(max_workers=_STAMP_THREADS) as pool:
        stamp_of = dict(zip(flat, pool.map(_stamp, flat)))
    return [(group, "\n".join(f"{u}={stamp_of[u]}" for u in sorted(whole))) for group, whole in zip(files, stamped)]


def _extra(dataset: Any, index: int) -> dict[str, Any]:
    """Label, split and patient: what the dataset knows of a volume without reading it."""
    extra = {}
    for name in ("label", "split", "patient"):
        method = getattr(dataset, name, None)
        extra[name] = method(index) if callable(method) else None
    return extra


def _listing(fs: Any, folder: str) -> list[str]:
    """The names in ``folder``, asked now: workers in other processes wrote into it since any
    listing this client cached (gcsfs keeps them)."""
    fs.invalidate_cache(folder)
    try:
        return fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []


def _entry_names(fs: Any, root: str, *, leftovers: bool = False) -> list[str]:
    """The commit records in ``entries/``; with ``leftovers``, instead the temporary files of
    workers killed while writing one (``.tmp-*``), which are no record."""
    return [n for n in _listing(fs, join(root, ENTRIES))
            if os.path.basename(n.rstrip("/")).startswith(".tmp-") == leftovers]


def _key_of(name: str) -> str:
    return os.path.basename(name.rstrip("/")).removesuffix(".json")


def _read_entries(fs: Any, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    found = fs.cat(list(names)) if names else {}
    entries = {}
    for name, data in found.items():
        try:
            entries[_key_of(name)] = json.loads(data)
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
        except ValueError as exc:
            raise UserError(f"--scheduler {scheduler!r} is not a Dask scheduler address ({exc})") from None
    # Processes, one thread each: prepare is CPU-bound numpy/torch work that
    # holds the GIL in places; separate processes scale it with the cores.
    # No dashboard; the scheduler's HTTP server (health checks) still starts, on a free port
    # (":0"): by default it takes 8787 and warns when another cluster holds it.
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                           scheduler_kwargs={"dashboard": False},
                           silence_logs=logging.CRITICAL)  # failures: said once, here
    client = Client(cluster)
    client.run(_quiet_library_logs)  # a store's retries and tracebacks are not the console's
    return client, cluster


def _quiet_library_logs() -> None:
    """In a worker process: the libraries beneath (gcsfs, aiohttp, ...) log nowhere, so Python's
    last-resort handler does not print their retry tracebacks; the main process says what failed."""
    from octfw.display.logs import THIRD_PARTY_LEVELS

    for name in THIRD_PARTY_LEVELS:
        library = logging.getLogger(name)
        library.addHandler(logging.NullHandler())
        library.propagate = False


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
                cause = storage_cause(error, location)
                if cause is not None:  # the store, not the file: exit 74, and the same command finishes it
                    raise PrepareStopped(f"--out {location}: the prepare stopped at {dataset.source(index)}: {cause}; "
                                         "the volumes written so far are kept: run the same command again to finish")
                raise UserError(f"preparing {dataset.source(index)} failed: {type(error).__name__}: {error} "
                                "(volumes done so far are kept; run `octfw prepare` again to continue)")
            done += 1
            if progress is not None:
                progress(done, len(todo))
            yield key, future.result()
    finally:
        client.cancel(list(futures))


def prepare_dataset(recipe: Recipe, registry: Registry, location: str, *, scheduler: str | None = None,
                    workers: int | None = None, dtype: str = "auto", add: bool = False, replace: bool = False,
                    prune: bool = False, progress: Progress | None = None,
                    report: Callable[[str], None] = print) -> PrepareSummary:
    """Prepare the recipe's dataset into ``location``; see the module docstring.

    ``add``: merge this recipe's volumes into a location that holds another
    dataset (same transform options). ``replace``: rebuild the location for
    this recipe alone (implies ``prune``). ``prune``: remove the volumes the
    new snapshot no longer lists, once it is written.
    """
    started = time.perf_counter()
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    if add and replace:
        raise UserError("--add and --replace: give one (--add merges into the location, --replace rebuilds it)")
    location = check_out(location)
    if scheduler is not None:
        _check_scheduler(scheduler)
    from octfw.storage.reach import require_reachable

    require_reachable(location, "--out")  # seconds, not gcsfs's minute of retries
    ctx = recipe.build_context(registry=registry)
    dataset = recipe.dataset.build(ctx)
    transform = recipe.transform.build(ctx)
    if not isinstance(transform, StorableTransform):
        raise UserError(f"transform {recipe.transform.name!r} has no deterministic prepare() half to store "
                        "(octfw.types.StorableTransform)")
    if not isinstance(dataset, SourcedDataset):
        raise UserError(f"dataset {recipe.dataset.name!r} does not name its sources (source(i)); it cannot be prepared")
    if isinstance(dataset, PreparedVolumesDataset):
        raise UserError(f"dataset {recipe.dataset.name!r} is prepared already")
    transform.cache = None  # the prepared location is the cache; never fill the local one
    options = transform.prepare_options()
    table = recipe.dataset.to_table()

    fs, root = open_filesystem(location, setting="--out")
    with _library_log(ctx.cache_dir, location), FolderOwner(location, "--out", lock_name=LOCK_FILE,
                                                            lease_s=LEASE_S):
        previous = read_header(location, must_be_complete=False)
        sources = {dataset.source(i) for i in range(len(dataset))}
        plan = _plan(location, fs, root, previous, options, table, sources,
                     add=add, replace=replace, prune=prune or replace)
        header = Header(transform=options, transform_key=transform.cache_key(),
                        image_size=tuple(transform.image_size), dtype=dtype, datasets=plan.datasets,
                        key_salt=plan.salt)
        if previous is None or not previous.complete:
            # No snapshot to keep: mark the location partly written before any work.
            write_atomically(join(location, HEADER_FILE), header.to_bytes())
        report(f"prepare   {counted(len(dataset), 'source')} of [dataset] {recipe.dataset.name!r} -> "
               f"{location}{plan.note}")
        try:
            summary = _prepare(dataset, transform, location, fs, root, header, previous, plan,
                               this=dataset_id(table), scheduler=scheduler, workers=workers, dtype=dtype,
                               progress=progress, report=report)
        except UserError:
            raise  # said already, in its own words (an unreachable --scheduler, a refused location)
        except Exception as exc:  # noqa: BLE001 - a storage fault is one line; anything else keeps its traceback
            cause = storage_cause(exc, location)
            if cause is None:
                raise
            logger.debug("the prepare into %s stopped", location, exc_info=exc)  # the traceback: the log file
            raise PrepareStopped(f"--out {location}: the prepare stopped: {cause}; the volumes written so far are "
                                 "kept: run the same command again to finish") from None
    return attrs.evolve(summary, seconds=time.perf_counter() - started)


class PrepareStopped(UserError):
    """A storage fault stopped a prepare (out of space, read-only, unreachable): exit 74, and the
    same command finishes it once the location works again."""

    exit_code = SAVE_FAILED_EXIT_CODE


def _prepare(dataset: Any, transform: Any, location: str, fs: Any, root: str, header: Header,
             previous: Header | None, plan: _Plan, *, this: str, scheduler: str | None, workers: int | None,
             dtype: str, progress: Progress | None, report: Callable[[str], None]) -> PrepareSummary:
    stamps = _stamps(dataset)
    work = [(i, volume_key(dataset.source(i), stamp, plan.salt), files) for i, (files, stamp) in enumerate(stamps)]
    keys = {key for _i, key, _f in work}
    entries = _read_entries(fs, [n for n in _entry_names(fs, root) if _key_of(n) in keys])
    todo = [(i, key, files) for i, key, files in work if key not in entries]
    reused = len(work) - len(todo)
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

    mine = [{**entries[key]["row"], "dataset": this} for _i, key, _f in work if "row" in entries[key]]
    quarantined = [{**entries[key]["quarantined"], "key": key, "dataset": this}
                   for _i, key, _f in work if "quarantined" in entries[key]]
    rows = [r.to_json() for r in plan.kept_rows] + mine
    quarantine = [dict(q) for q in plan.kept_quarantine] + quarantined
    quarantine_bytes = encode_lines(quarantine)
    quarantine_name = snapshot_name("quarantine", quarantine_bytes)
    write_atomically(join(location, quarantine_name), quarantine_bytes)
    if not mine:
        kept = "keeps its previous snapshot" if previous is not None and previous.complete else "has no snapshot yet"
        if not work:
            raise UserError(f"the recipe's dataset lists no volumes; --out {location} {kept}")
        raise UserError(f"none of the {len(work)} volumes of the recipe's dataset could be used; why: "
                        f"{join(location, quarantine_name)}; --out {location} {kept}")

    index_bytes = encode_lines(rows)
    index_name = snapshot_name("index", index_bytes)
    write_atomically(join(location, index_name), index_bytes)
    header = attrs.evolve(header, complete=True, volumes=len(rows), quarantined=len(quarantine),
                          index_sha256=hashlib.sha256(index_bytes).hexdigest(), index=index_name,
                          quarantine=quarantine_name)
    write_atomically(join(location, HEADER_FILE), header.to_bytes())  # the switch: readers see it whole

    keep = {r["key"] for r in rows} | {str(q["key"]) for q in quarantine if q.get("key")}
    _remove_old_snapshots(fs, root, {index_name, quarantine_name} | (
        {previous.index, previous.quarantine} if previous is not None and previous.complete else set()))
    stale = [n for n in _entry_names(fs, root) if _key_of(n) not in keep]
    removed: list[str] = []
    if plan.prune:
        removed = _remove_stale(fs, root, stale, keep)
    return PrepareSummary(location=location, volumes=len(rows), prepared=len(todo), reused=reused,
                          quarantined=len(quarantine), removed=len(removed),
                          stored_bytes=sum(int(r["nbytes"]) for r in rows), seconds=0.0, workers=used_workers,
                          stale=0 if plan.prune else len(stale), removed_sources=tuple(removed),
                          kept=len(plan.kept_rows), quarantine_file=join(location, quarantine_name))


def _remove_old_snapshots(fs: Any, root: str, keep: set[str]) -> None:
    """Index and quarantine files of snapshots before the previous one (a reader that has just read the
    previous header may still open its index; nothing reads older ones)."""
    for name in _listing(fs, root):
        base = os.path.basename(name.rstrip("/"))
        old = base in (INDEX_FILE, QUARANTINE_FILE) or (
            base.startswith(("index-", "quarantine-")) and base.endswith(".jsonl"))
        if old and base not in keep:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(name)


def _remove_stale(fs: Any, root: str, stale_entries: Sequence[str], keep: set[str]) -> list[str]:
    """Delete the volumes and entries the new snapshot does not list (only after its header is written);
    returns the sources of the removed volumes."""
    sources = []
    for entry in _read_entries(fs, stale_entries).values():
        record = entry.get("row") or entry.get("quarantined") or {}
        sources.append(str(record.get("source", "?")))
    # Arrays without an entry too: a killed task's leftovers.
    arrays = [n for folder in (VOLUMES, LAYERS) for n in _listing(fs, join(root, folder)) if _key_of(n) not in keep]
    for name in arrays:
        fs.rm(name, recursive=True)
    # Entries last: a volume without an entry is never read.
    for name in [*stale_entries, *_entry_names(fs, root, leftovers=True)]:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(name)
    return sorted(sources)
