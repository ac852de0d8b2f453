"""The local checkpointer: atomic saves, the latest pointer, pruning, safe loading."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from octfw.plugins.checkpointers.local import LocalCheckpointConfig, build, checkpoint_name
from octfw.display.errors import UserError
from octfw.recipe.fields import Location
from octfw.types import BuildContext, Checkpointer


def make_ctx(run_dir: Path | None, rank: int = 0) -> BuildContext:
    return BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=run_dir, seed=0, rank=rank)


def small_state(step: int) -> dict:
    return {
        "update_step": step,
        "model": {"w": torch.full((2, 3), float(step)), "b": torch.zeros(3)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
        "rng": {"torch": torch.random.get_rng_state(), "python": [3, (1, 2), None]},
        "config": {"name": "smoke", "dtype": torch.bfloat16, "ratio": 0.6, "flag": True},
    }


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def pointed(folder: Path) -> str:
    """The checkpoint name the ``latest`` pointer lists first (pointer format 1)."""
    return json.loads((folder / "latest").read_text())["checkpoints"][0]["name"]


def test_round_trip_in_run_dir_by_default(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    assert isinstance(ckpt, Checkpointer)
    assert ckpt.latest() is None
    state = small_state(12)
    location = ckpt.save(12, state)
    assert location == str(tmp_path / "checkpoints" / "step_00000012.pt")
    assert pointed(tmp_path / "checkpoints") == "step_00000012.pt"
    assert ckpt.latest() == location
    loaded = ckpt.load(location)
    assert loaded["update_step"] == 12
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    assert loaded["optimizer"]["state"][0]["exp_avg"].tolist() == [1.0, 1.0]
    assert loaded["config"] == state["config"]
    assert names(tmp_path / "checkpoints") == ["latest", "step_00000012.pt", "step_00000012.pt.sha256"]


def test_dir_option_and_file_url(tmp_path):
    ckpt = build(LocalCheckpointConfig(dir=Location(f"file://{tmp_path}/elsewhere")), make_ctx(None))
    location = ckpt.save(1, {"x": torch.ones(1)})
    assert Path(location).parent == tmp_path / "elsewhere"
    assert ckpt.load(f"file://{location}")["x"].item() == 1.0


def test_remote_dir_is_refused(tmp_path):
    with pytest.raises(UserError, match="gcs"):
        build(LocalCheckpointConfig(dir=Location("gs://bucket/ckpt")), make_ctx(tmp_path))


def test_keep_last_prunes_older_checkpoints(tmp_path):
    ckpt = build(LocalCheckpointConfig(keep_last=2), make_ctx(tmp_path))
    for step in (10, 20, 30, 40):
        ckpt.save(step, small_state(step))
    assert names(tmp_path / "checkpoints") == ["latest", "step_00000030.pt", "step_00000030.pt.sha256", "step_00000040.pt", "step_00000040.pt.sha256"]
    assert ckpt.latest().endswith("step_00000040.pt")


def test_prune_never_deletes_the_checkpoint_latest_names(tmp_path):
    ckpt = build(LocalCheckpointConfig(keep_last=1), make_ctx(tmp_path))
    ckpt.save(50, small_state(50))
    # A resumed run that restarts numbering below the pointer (e.g. a
    # different run's folder) must not lose the checkpoint 'latest' names.
    ckpt.save(5, small_state(5))
    folder = tmp_path / "checkpoints"
    assert (folder / "step_00000005.pt").exists()
    assert pointed(folder) == "step_00000005.pt"


def test_latest_ignores_tmp_leftovers(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    ckpt.save(10, small_state(10))
    folder = tmp_path / "checkpoints"
    (folder / "latest").unlink()  # no pointer: the newest complete file wins
    (folder / "step_00000099.pt.tmp").write_bytes(b"half a checkpoint")
    assert ckpt.latest() == str(folder / "step_00000010.pt")


def test_interrupted_save_leaves_latest_on_previous_checkpoint(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    first = ckpt.save(10, small_state(10))
    folder = tmp_path / "checkpoints"
    # The process died after writing the .tmp of step 20 and before the rename.
    (folder / "step_00000020.pt.tmp").write_bytes(b"\x80\x02truncated")
    assert ckpt.latest() == first
    assert ckpt.load(ckpt.latest())["update_step"] == 10
    # The next complete save clears the leftover.
    ckpt.save(30, small_state(30))
    assert not (folder / "step_00000020.pt.tmp").exists()


def test_failed_save_raises_and_keeps_latest(tmp_path, monkeypatch):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    first = ckpt.save(10, small_state(10))

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        ckpt.save(20, small_state(20))
    monkeypatch.undo()
    assert ckpt.latest() == first
    assert names(tmp_path / "checkpoints") == ["latest", "step_00000010.pt", "step_00000010.pt.sha256"]


def test_only_rank_zero_saves(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path, rank=1))
    assert ckpt.save(10, small_state(10)) == ""
    assert not (tmp_path / "checkpoints").exists()


def test_state_that_weights_only_cannot_load_is_refused_at_save(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    with pytest.raises(TypeError, match=r"state\['rng'\]\['numpy'\] is a numpy.ndarray"):
        ckpt.save(10, {"rng": {"numpy": np.zeros(3)}})
    assert ckpt.latest() is None


class Payload:
    """An arbitrary object: unpickling it with weights_only=False would run its code."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_load_refuses_a_pickled_arbitrary_object(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": Payload()}, path)
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    with pytest.raises(UserError, match="cannot be loaded safely .*GLOBAL posix.system"):
        ckpt.load(str(path))


def test_load_of_missing_file_names_it(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    with pytest.raises(UserError, match="step_00000001.pt does not exist"):
        ckpt.load(str(tmp_path / checkpoint_name(1)))


def test_pointer_outside_the_folder_is_not_followed(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    location = ckpt.save(3, small_state(3))
    (tmp_path / "checkpoints" / "latest").write_text("../../etc/passwd")
    assert ckpt.latest() == location


def test_ordered_dict_state_round_trips(tmp_path):
    ckpt = build(LocalCheckpointConfig(), make_ctx(tmp_path))
    model = torch.nn.Linear(2, 2)
    location = ckpt.save(1, {"model": model.state_dict()})
    assert isinstance(model.state_dict(), collections.OrderedDict)
    loaded = ckpt.load(location)["model"]
    assert torch.equal(loaded["weight"], model.weight.detach())


def test_keep_last_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        LocalCheckpointConfig(keep_last=0)
