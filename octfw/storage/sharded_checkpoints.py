"""Sharded checkpoints: a folder in which every process writes its own slices of the state.

A run with ``engine.parallelism = "fsdp"`` holds each tensor in slices, one per process.
Gathering them to one process to ``torch.save`` one file costs that process the whole
state in memory and makes it write every byte; instead each process writes its own
slices, at once, through ``torch.distributed.checkpoint`` (DCP)::

    step_00000120.dcp/
        __0_0.distcp          rank 0's slices (DCP's file per process)
        __0_0.distcp.sha256   its SHA-256, computed while it was written
        __1_0.distcp ...      every other rank's, each with its .sha256
        plain.pt              the plain part of the state (steps, RNG, the recipe), rank 0's
        plain.pt.sha256
        .metadata             DCP's index of which slice of which tensor is where: written
                              last, once every process has written its file

The folder is a checkpoint like a ``step_N.pt`` file: the ``latest`` pointer names it
only after ``.metadata`` exists (:class:`octfw.storage.checkpoints.CheckpointStorage`),
and a folder whose files do not match their SHA-256 is skipped for the previous one.

**Reading runs no code from the files.** DCP writes ``.metadata`` with ``pickle``, which
can run code on load; it is read here by an unpickler that builds only DCP's own index
classes and torch's sizes and dtypes, and refuses anything else (:func:`read_metadata`).
Tensors are read by DCP with ``torch.load(weights_only=True)``; octfw never writes DCP's
other kind of entry (pickled Python values, which DCP loads unrestricted), so a folder
holding one is refused. The plain part is read with ``weights_only`` like any checkpoint.

**Resharding.** Written by N processes, read by any M: a sharded run fills its own slices
in place, each process reading only the parts of the files that overlap them
(:func:`read_into`), whatever sharding wrote them; one process (a ``data`` run, ``octfw
export``) reads the folder whole into plain tensors (:func:`read_sharded`).

Light at import time (stdlib only): torch loads inside the functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import pickle
import posixpath
import warnings
from typing import Any, Callable, Iterator, Mapping

from octfw.display.errors import UserError
from octfw.storage.checkpoint_reading import CorruptCheckpoint, parse_checksum, safe_load
from octfw.storage.files import HashingWriter, is_local_filesystem

__all__ = ["METADATA", "PLAIN", "write_sharded", "read_sharded", "read_into", "read_metadata", "damage",
           "is_written"]

logger = logging.getLogger(__name__)

#: DCP's index of the folder, written last: a folder without it is an unfinished save.
METADATA = ".metadata"
#: The plain (unsharded) part of the state, rank 0's.
PLAIN = "plain.pt"
_SHARD_SUFFIX = ".distcp"

# What DCP's index may hold, and nothing else: (module, name) pairs the unpickler may build.
_INDEX_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's index classes, torch sizes and dtypes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _INDEX_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's index")


def read_metadata(data: bytes, location: str) -> Any:
    """DCP's ``.metadata`` of the folder at ``location``, read without running code from it;
    UserError for anything but DCP's index of tensors."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    try:
        metadata = _IndexUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - refused or damaged: never executed either way
        raise UserError(f"checkpoint {location}: its {METADATA} cannot be read safely "
                        f"({type(exc).__name__}: {exc}); octfw reads DCP's index of tensors only") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"checkpoint {location}: its {METADATA} is a {type(metadata).__name__}, not DCP's index")
    pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    if pickled:
        raise UserError(f"checkpoint {location} holds pickled values ({', '.join(pickled[:3])}), which octfw "
                        "never writes and never loads: they could run code")
    return metadata


def _filesystem(fs: Any) -> Any:
    """DCP's view of the fsspec filesystem ``fs``: the checkpoint folder's own (its options,
    its retries), recording the SHA-256 of every file this process writes."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class StoreFileSystem(FileSystemBase):
        def __init__(self) -> None:
            self.written: dict[str, str] = {}  #: path -> SHA-256 of each file this process wrote

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with fs.open(str(path), mode) as file:
                if "w" not in mode:
                    yield file
                    return
                hashing = HashingWriter(file)
                yield hashing
            self.written[str(path)] = hashing.digest.hexdigest()

        def concat_path(self, path: Any, suffix: str) -> str:
            return posixpath.join(str(path), suffix)

        def rename(self, path: Any, new_path: Any) -> None:
            # DCP writes its index as .metadata.tmp and renames it. Object stores have no
            # rename (the GCS emulator no copy either): a second upload, then the first deleted.
            if is_local_filesystem(fs):
                fs.mv(str(path), str(new_path))
            else:
                fs.pipe_file(str(new_path), fs.cat_file(str(path)))
                fs.rm_file(str(path))

        def init_path(self, path: Any, **kwargs: Any) -> str:
            return str(path)

        def mkdir(self, path: Any) -> None:
            if not getattr(fs, "async_impl", False):  # object stores have no folders
                fs.makedirs(str(path), exist_ok=True)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def exists(self, path: Any) -> bool:
            return fs.exists(str(path))

        def rm_file(self, path: Any) -> None:
            fs.rm_file(str(path))

    return StoreFileSystem()


def _writer(fs: Any, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    class ChecksummedWriter(FileSystemWriter):
        """DCP's writer into ``fs``; each file's SHA-256 written beside it before the index."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)  # synchronous: every file of this rank written
            for file, digest in self.fs.written.items():
                fs.pipe_file(f"{file}.sha256", f"{digest}  {posixpath.basename(file)}\n".encode("utf-8"))
            self.fs.written.clear()
            return written

    writer = ChecksummedWriter(path, sync_files=is_local_filesystem(fs), overwrite=True)
    writer.fs, writer.path = _filesystem(fs), path
    return writer


def write_sharded(fs: Any, path: str, shards: Mapping[str, Any], plain: Mapping[str, Any] | None,
                  group: Any = None) -> None:
    """Write the folder ``path`` in ``fs``: this process's slices of ``shards`` (DTensors, or
    whole tensors every process holds alike), and ``plain`` where given (rank 0). Every process
    of ``group`` calls it; it returns once the index is written (DCP's own collectives on
    ``group``, so a save off the training thread uses a group of its own)."""
    import torch
    import torch.distributed.checkpoint as dcp

    if plain is not None:
        stream_fs = _filesystem(fs)
        stream_fs.mkdir(path)
        target = posixpath.join(path, PLAIN)
        with stream_fs.create_stream(target, "wb") as file:
            torch.save(dict(plain), file)
        fs.pipe_file(f"{target}.sha256", f"{stream_fs.written[target]}  {PLAIN}\n".encode("utf-8"))
    with warnings.catch_warnings():  # DCP's own use of TypedStorage, deprecated in torch
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        dcp.save(dict(shards), storage_writer=_writer(fs, path), process_group=group)


def is_written(fs: Any, path: str) -> bool:
    """Whether the folder's index exists: every process finished writing its slices."""
    return fs.exists(posixpath.join(path, METADATA))


def _files(fs: Any, path: str, location: str) -> tuple[Any, list[str]]:
    """(the folder's index, the files it needs: every shard file it names, and the plain part)."""
    try:
        raw = fs.cat_file(posixpath.join(path, METADATA))
    except FileNotFoundError:
        raise UserError(f"checkpoint {location} is not a complete sharded checkpoint (no {METADATA})") from None
    metadata = read_metadata(raw, location)
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return metadata, sorted(named) + [PLAIN]


def damage(fs: Any, path: str, location: str, files: list[str] | None = None) -> str | None:
    """Why the folder at ``path`` cannot be trusted (a file missing, or not the bytes whose
    SHA-256 was recorded when it was written), or None when every file matches (every file
    the index needs, or those of ``files``)."""
    if files is None:
        _, files = _files(fs, path, location)
    for name in files:
        file = posixpath.join(path, name)
        try:
            expected = parse_checksum(fs.cat_file(f"{file}.sha256"))
            digest = hashlib.sha256()
            with fs.open(file, "rb") as stream:
                while block := stream.read(1 << 24):
                    digest.update(block)
        except FileNotFoundError:
            return f"{name} is missing"
        if expected is None or digest.hexdigest() != expected:
            return f"{name} does not match the SHA-256 recorded when it was written"
    return None


def _reader(fs: Any, path: str, metadata: Any) -> Any:
    """DCP's reader of the folder, handed the index read by :func:`read_metadata` (never its own
    unpickling of it)."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

    reader = SafeReader(path)
    reader.fs, reader.path = _filesystem(fs), path
    return reader


def _read_plain(fs: Any, path: str, location: str) -> dict[str, Any]:
    with fs.open(posixpath.join(path, PLAIN), "rb") as file:
        return safe_load(io.BytesIO(file.read()), location)


def read_sharded(fs: Any, path: str, location: str) -> dict[str, Any]:
    """The whole state of the folder at ``path``: every tensor whole, on the CPU, and the
    plain part, as one nested dict (what was given to :func:`write_sharded`, merged).
    Checked first: :class:`CorruptCheckpoint` for a damaged file, UserError for a folder
    that is not a complete sharded checkpoint or holds what could run code."""
    import torch
    import torch.distributed.checkpoint as dcp

    why = damage(fs, path, location)
    if why is not None:
        raise CorruptCheckpoint(f"checkpoint {location} is damaged: {why}; it is not loaded")
    metadata, _ = _files(fs, path, location)
    flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=_reader(fs, path, metadata), no_dist=True)  # every slice, here
    except Exception as exc:  # noqa: BLE001 - a file cut short after its checksum was checked
        raise UserError(f"checkpoint {location} cannot be read ({type(exc).__name__}: {exc})") from None
    return _merged(_read_plain(fs, path, location), _unflattened(flat, metadata.planner_data))


def read_into(fs: Any, path: str, location: str, shards: dict[str, Any],
              check: Callable[[dict[str, Any]], None] = lambda plain: None,
              optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fill ``shards`` (this run's own tensors, sliced as its model is: DTensors) in place from
    the folder at ``path``, each process reading only the slices it holds, whatever the number
    of processes and the sharding that wrote them; returns the whole state, ``shards`` merged
    into the plain part. Every process of the job calls it (DCP's collectives on the default
    group). The files are checked first, each by one process (:class:`CorruptCheckpoint` on
    every process if one is damaged); ``check(plain)`` runs before any tensor is read (a
    refusal of another model names the recipe's difference, not a shape). A tensor of
    ``shards`` whose key starts with one of ``optional`` (the optimizer's moments: a parameter
    that never had a gradient has none) and that the checkpoint lacks is left out; any other
    missing one is refused."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    metadata, files = _files(fs, path, location)
    rank, world = dist.get_rank(), dist.get_world_size()
    verdicts: list[str | None] = [None] * world
    dist.all_gather_object(verdicts, damage(fs, path, location, files[rank::world]))
    why = next((v for v in verdicts if v is not None), None)
    if why is not None:
        raise CorruptCheckpoint(f"checkpoint {location} is damaged: {why}; it is not loaded")
    plain = _read_plain(fs, path, location)
    check(plain)
    saved = set(metadata.state_dict_metadata)
    shards = _pruned(shards, lambda key: key in saved or not key.startswith(optional))
    wanted = set(_flat_keys(shards))
    # Either way a tensor would be lost without a word: one this run needs that the checkpoint
    # lacks, or one the checkpoint holds that this run has no place for (load_state_dict's strict).
    for keys, what in ((sorted(wanted - saved), "has no"), (sorted(saved - wanted), "holds, and this run has no place for,")):
        if keys:
            raise UserError(f"checkpoint {location} {what} {', '.join(keys[:3])}"
                            f"{' ...' if len(keys) > 3 else ''}: written by another model")
    try:
        dcp.load(shards, storage_reader=_reader(fs, path, metadata))
    except Exception as exc:  # noqa: BLE001 - sizes that do not fit, a file cut short
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UserError(f"checkpoint {location} cannot be read into this model ({type(exc).__name__}: "
                        f"{first})") from None
    return _merged(plain, shards)


def _unflattened(flat: Mapping[str, Any], paths: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flat keys back into the nested dict they came from: the index records each key's
    path of keys (its ``planner_data``)."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = paths[key]
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def _pruned(tree: Mapping[str, Any], keep: Callable[[str], bool], prefix: str = "") -> dict[str, Any]:
    """``tree`` without the leaves whose flat key ``keep`` rejects (emptied dicts dropped too)."""
    pruned: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            inner = _pruned(value, keep, f"{prefix}{key}.")
            if inner:
                pruned[key] = inner
        elif keep(f"{prefix}{key}"):
            pruned[key] = value
    return pruned


def _flat_keys(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """DCP's flat keys of a nested dict ("model.blocks.0.weight", "optimizer.state.0.exp_avg")."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _merged(plain: dict[str, Any], shards: Mapping[str, Any]) -> dict[str, Any]:
    """``plain`` with ``shards`` put in, nested dicts merged key by key."""
    merged = dict(plain)
    for key, value in shards.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merged(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged
