"""The storage layer: URL resolution, atomic writes, and one checkpoint folder layout for every store."""

from __future__ import annotations

import ast
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from octfw.plugins.checkpointers.gcs import GcsCheckpointConfig
from octfw.plugins.checkpointers.gcs import build as build_gcs
from octfw.plugins.checkpointers.local import LocalCheckpointConfig, LocalCheckpointer
from octfw.plugins.checkpointers.local import build as build_local
from octfw.display.errors import UserError
from octfw.recipe.fields import Location
from octfw.storage.checkpoint_names import LATEST, PointerEntry, format_pointer, parse_pointer
from octfw.storage.checkpoints import load_checkpoint
from octfw.storage.checkpoints import CheckpointStorage
from octfw.storage.files import is_local, local_path, open_filesystem, write_atomically
from octfw.storage.retry import RetryPolicy, StorageError
from octfw.types import BuildContext

BUCKET = "octfw-storage"


def make_ctx(run_dir: Path | None) -> BuildContext:
    return BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=run_dir, seed=0)


def state(step: int) -> dict:
    return {"update_step": step, "model": {"w": torch.full((3, 3), float(step))}}


# --- URLs -------------------------------------------------------------------------


def test_plain_path_and_file_url_resolve_to_the_same_local_file(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    target = tmp_path / "a" / "b.bin"
    for url in (str(target), f"file://{target}"):
        assert is_local(url)
        assert local_path(url) == str(target)
        fs, path = open_filesystem(url)
        assert isinstance(fs, LocalFileSystem) and path == str(target)
    assert Location(f"file://{target}").local_path == str(target)
    assert not Location(f"file://{target}").is_remote and Location("gs://b/x").is_remote


def test_remote_url_is_not_local_and_has_no_local_path():
    assert not is_local("gs://bucket/run")
    with pytest.raises(ValueError, match="not a local path"):
        local_path("gs://bucket/run")
    assert Location("gs://bucket/run").local_path == "gs://bucket/run"  # unchanged, as before


def test_gs_url_resolves_to_gcsfs_with_the_bucket_path(gcs):
    import gcsfs

    fs, path = open_filesystem("gs://some-bucket/runs/a", fresh=True)
    assert isinstance(fs, gcsfs.GCSFileSystem)
    assert path == "some-bucket/runs/a"
    again, _ = open_filesystem("gs://some-bucket/runs/a", fresh=True)
    assert again is not fs  # fresh: no client (endpoint, credentials) shared with an earlier one


def test_unknown_protocol_is_a_user_error_naming_the_setting():
    with pytest.raises(UserError, match=r"checkpointer.dir = 'nosuch://x'"):
        open_filesystem("nosuch://x", setting="checkpointer.dir")


# --- atomic writes ------------------------------------------------------------------


def test_atomic_write_replaces_the_file_and_returns_its_size(tmp_path):
    target = tmp_path / "new" / "file.bin"
    assert write_atomically(target, b"first") == 5
    assert write_atomically(str(target), lambda f: f.write(b"second!")) == 7
    assert target.read_bytes() == b"second!"
    assert os.listdir(target.parent) == ["file.bin"]


@pytest.mark.parametrize("temp_name", [None, "file.bin.tmp"])
def test_atomic_write_leaves_no_partial_file_when_the_writer_raises(tmp_path, temp_name):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old bytes")

    def half_then_fail(f):
        f.write(b"half of the new")
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        write_atomically(target, half_then_fail, temp_name=temp_name)
    assert target.read_bytes() == b"old bytes"
    assert os.listdir(tmp_path) == ["file.bin"]


def test_durable_write_fsyncs_the_file_then_its_folder(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd):
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    write_atomically(tmp_path / "durable.bin", b"x")
    assert synced == ["file", "folder"]  # the folder holds the rename
    synced.clear()
    write_atomically(tmp_path / "cache.bin", b"x", durable=False)
    assert synced == []


def test_remote_write_is_one_object_put_in_place(tmp_path):
    url = f"memory://{tmp_path.name}/objects/x.bin"
    assert write_atomically(url, lambda f: f.write(b"payload")) == 7
    fs, path = open_filesystem(url)
    assert fs.cat_file(path) == b"payload"
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path]  # no temporary object beside it


# --- the pointer --------------------------------------------------------------------


def test_pointer_round_trips_and_refuses_what_it_cannot_trust():
    entries = [PointerEntry("step_00000020.pt", 120), PointerEntry("step_00000010.pt", 100)]
    assert parse_pointer(format_pointer(entries)) == entries
    assert json.loads(format_pointer(entries))["format"] == 1
    assert parse_pointer(b"step_00000020.pt\n") == [PointerEntry("step_00000020.pt", None)]  # old format
    assert parse_pointer(b"../../etc/passwd") == []
    assert parse_pointer(b'{"format": 1, "checkpoints": [{"name": "../x.pt", "bytes": 1}]}') == []
    assert parse_pointer(b'{"format": 2, "checkpoints": []}') == []
    assert parse_pointer(b'{"format": 1, "checkp') == []
    assert parse_pointer(b"\xff\xfe") == []


def test_old_format_latest_pointer_still_loads_and_the_next_save_rewrites_it(tmp_path):
    # A folder as octfw wrote it before pointer format 1: `latest` holds a bare name.
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (10, 20):
        torch.save(state(step), folder / f"step_{step:08d}.pt")
    (folder / LATEST).write_text("step_00000010.pt")  # an older one, on purpose: the pointer wins

    checkpointer = LocalCheckpointer(folder, keep_last=3)
    assert checkpointer.latest() == str(folder / "step_00000010.pt")
    assert checkpointer.load(checkpointer.latest())["update_step"] == 10

    checkpointer.save(30, state(30))
    pointer = json.loads((folder / LATEST).read_text())
    assert pointer == {"format": 1, "checkpoints": [
        {"name": "step_00000030.pt", "bytes": (folder / "step_00000030.pt").stat().st_size},
        {"name": "step_00000010.pt", "bytes": (folder / "step_00000010.pt").stat().st_size},
    ]}
    assert checkpointer.latest() == str(folder / "step_00000030.pt")


# --- one folder layout on every store ---------------------------------------------------


@pytest.fixture(params=["local", "gcs"])
def folder_url(request, tmp_path) -> str:
    """A checkpoint folder on a local disk, then in the GCS emulator."""
    if request.param == "local":
        return str(tmp_path / "checkpoints")
    emulator = request.getfixturevalue("gcs")
    emulator.make_bucket(BUCKET)
    return f"gs://{BUCKET}/checkpoints"


def listing(storage: CheckpointStorage) -> list[str]:
    paths = storage.fs.ls(storage.root, detail=False, refresh=True)
    return sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in paths)


def test_retention_keeps_the_newest_n_through_the_shared_code(folder_url):
    storage = CheckpointStorage(folder_url, keep_last=2)
    for step in (1, 2, 3, 4):
        assert storage.save(step, state(step)) == f"{folder_url}/step_{step:08d}.pt"
    assert listing(storage) == [LATEST, "step_00000003.pt", "step_00000003.pt.sha256",
                                "step_00000004.pt", "step_00000004.pt.sha256"]
    assert [step for step, _ in storage.checkpoints()] == [3, 4]
    pointer = json.loads(storage.fs.cat_file(f"{storage.root}/{LATEST}"))
    assert [(e["name"], e["bytes"]) for e in pointer["checkpoints"]] == [
        (name, storage.fs.size(f"{storage.root}/{name}")) for name in ("step_00000004.pt", "step_00000003.pt")
    ]
    assert storage.latest() == f"{folder_url}/step_00000004.pt"
    assert storage.load(storage.latest())["update_step"] == 4


def test_a_truncated_newest_checkpoint_gives_way_to_the_one_before(folder_url):
    storage = CheckpointStorage(folder_url, keep_last=3)
    storage.save(1, state(1))
    storage.save(2, state(2))
    storage.fs.pipe_file(f"{storage.root}/step_00000002.pt", b"cut short")
    assert storage.latest() == f"{folder_url}/step_00000001.pt"


def test_both_checkpointers_keep_their_folders_in_the_same_storage(tmp_path):
    local = build_local(LocalCheckpointConfig(keep_last=4), make_ctx(tmp_path))
    remote = build_gcs(GcsCheckpointConfig(dir=Location("gs://bucket/run"), keep_last=5), make_ctx(None))
    assert isinstance(local.storage, CheckpointStorage) and local.storage.keep_last == 4
    assert isinstance(remote.storage, CheckpointStorage) and remote.storage.keep_last == 5
    assert remote.storage.retry.retries == 3  # the gcs default; local retries nothing


def test_load_checkpoint_by_url_refuses_a_missing_file(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save(state(1), path)
    assert load_checkpoint(f"file://{path}")["update_step"] == 1
    with pytest.raises(UserError, match="step_00000002.pt does not exist"):
        load_checkpoint(str(tmp_path / "step_00000002.pt"))


def test_retry_policy_raises_permanent_errors_at_once_and_names_the_operation():
    waits: list[float] = []
    policy = RetryPolicy(retries=2, backoff_s=1.0, sleep=waits.append)

    def missing():
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        policy.run("read x", missing)
    assert waits == []

    def reset():
        raise ConnectionResetError("reset")

    with pytest.raises(StorageError, match="read x failed after 3 attempts: ConnectionResetError: reset"):
        policy.run("read x", reset)
    assert waits == [1.0, 2.0]
    with pytest.raises(StorageError, match="failed after 1 attempt: "):
        RetryPolicy().run("read x", reset)


# --- the layer's place ----------------------------------------------------------------


def test_storage_imports_no_higher_octfw_layer():
    allowed = ("octfw.storage", "octfw.display.errors", "octfw.recipe.fields", "octfw.types")
    for source in (Path(__file__).parents[1] / "octfw" / "storage").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "octfw":
                    assert name.startswith(allowed), f"{source.name} imports {name}: storage is a low layer"
