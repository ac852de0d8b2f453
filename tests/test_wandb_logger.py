"""The wandb logger offline, without network: one run folder per job, the run id kept across a resume."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from octfw.cli.main import main
from octfw.display.errors import UserError
from octfw.plugins.loggers.wandb import WandbConfig, WandbLogger, build
from octfw.types import BuildContext, Logger

WANDB_LOGGER = '\n[[logger]]\nname = "wandb"\nproject = "octfw-test"\ntags = ["tiny"]\n'


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Keep W&B's own settings and cache out of the home folder.
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def records(path: Path):
    """Records of a .wandb file: a 7-byte header, then LevelDB-log style chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_run(folder: Path) -> dict:
    """Run id, logged history rows and final summary of one offline run folder."""
    [wandb_file] = folder.glob("run-*.wandb")
    # wandb-core writes the file from its own process and may still be flushing
    # when finish() returns: wait for the run's closing "exit" record.
    deadline = time.monotonic() + 30
    while not any(r.WhichOneof("record_type") == "exit" for r in records(wandb_file)):
        assert time.monotonic() < deadline, f"{wandb_file} has no exit record"
        time.sleep(0.2)
    out: dict = {"history": [], "summary": {}}

    def key(item) -> str:  # keys with a "/" (loss/<domain>) are stored split
        return item.key or "/".join(item.nested_key)

    for record in records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["tags"] = record.run.run_id, list(record.run.tags)
        elif kind == "history":
            out["history"].append({key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            out["summary"].update({key(item): json.loads(item.value_json) for item in record.summary.update})
    return out


def run_folders(recipe: Path) -> tuple[Path, list[Path]]:
    run_dir = sorted((recipe.parent / "runs" / recipe.stem).iterdir())[-1]
    return run_dir, sorted((run_dir / "wandb").glob("offline-run-*"))


def test_offline_run_leaves_one_run_folder_with_the_metrics_and_a_resume_continues_its_id(
        offline, tiny_recipe):
    tiny_recipe.write_text(tiny_recipe.read_text() + WANDB_LOGGER)
    # A constant LR and EMA: extending the finished run below (--allow-recipe-change) cannot make them restart.
    sets = ["--set", "engine.checkpoint_every_steps=2", "--set", "scheduler.name=constant",
            "--set", "scheduler.ema_shape=constant"]
    assert main(["run", str(tiny_recipe), *sets, "--set", "run.max_steps=4"]) == 0
    run_dir, folders = run_folders(tiny_recipe)
    assert len(folders) == 1
    first = read_run(folders[0])
    assert first["tags"] == ["tiny"]
    rows = [row for row in first["history"] if "loss" in row]
    assert [row["_step"] for row in rows] == [1, 2, 3, 4]
    keys = set(rows[0])
    assert {"loss", "lr", "grad_norm", "skipped_updates", "samples_per_s"} <= keys
    assert any(key.startswith("loss/") for key in keys)  # per-domain losses
    assert first["summary"]["update_steps"] == 4 and first["summary"]["failed_saves"] == []
    assert "stopped" not in first["summary"]  # None values are left out, never "None"

    assert main(["run", str(tiny_recipe), *sets, "--set", "run.max_steps=6", "--resume", "auto",
                 "--allow-recipe-change"]) == 0
    resumed_dir, folders = run_folders(tiny_recipe)
    assert resumed_dir == run_dir and len(folders) == 2  # offline: one folder per process...
    second = read_run(folders[1])
    assert second["id"] == first["id"]  # ...of the same W&B run, which `wandb sync` merges
    assert [row["_step"] for row in second["history"] if "loss" in row] == [5, 6]


def test_logger_off_rank_zero_does_nothing(offline, tmp_path):
    ctx = BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path, run_dir=tmp_path, seed=0, rank=3)
    logger = build(WandbConfig(), ctx)
    assert isinstance(logger, Logger)
    logger.start(10, tmp_path, {})
    logger.log(1, {"loss": 1.0})
    logger.finish({"update_steps": 1})
    assert not (tmp_path / "wandb").exists() and logger.run_id is None


def test_state_dict_carries_the_run_id():
    logger = WandbLogger(WandbConfig())
    logger.load_state_dict({"run_id": "abc123"})
    assert logger.state_dict() == {"run_id": "abc123"}


def test_missing_wandb_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    ctx = BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path, run_dir=tmp_path, seed=0)
    with pytest.raises(UserError, match=r"pip install 'octfw\[wandb\]'"):
        build(WandbConfig(), ctx)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="'online', 'offline', 'disabled'"):
        WandbConfig(mode="sometimes")


def test_display_name_group_job_type_and_notes_reach_wandb_and_the_saved_recipe_runs_again(
        offline, tiny_recipe, capsys):
    """The saved recipe.toml of a run is a recipe: `octfw show` validates it and `octfw run` trains it."""
    options = ('run_name = "baseline-seed0"\ngroup = "baselines"\njob_type = "pretrain"\n'
               'notes = "first try"\n')
    tiny_recipe.write_text(tiny_recipe.read_text() + WANDB_LOGGER + options)
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=2"]) == 0
    run_dir, [folder] = run_folders(tiny_recipe)
    [wandb_file] = folder.glob("run-*.wandb")
    read_run(folder)  # waits for the run's exit record
    [run] = [r.run for r in records(wandb_file) if r.WhichOneof("record_type") == "run"][:1]
    assert (run.display_name, run.run_group, run.job_type, run.notes) == (
        "baseline-seed0", "baselines", "pretrain", "first try")

    saved = run_dir / "recipe.toml"
    text = saved.read_text()
    assert 'name = "wandb"' in text and 'run_name = "baseline-seed0"' in text
    capsys.readouterr()
    assert main(["show", str(saved)]) == 0
    assert 'group = "baselines"' in capsys.readouterr().out
    assert main(["run", str(saved), "--set", "run.max_steps=1"]) == 0


def test_the_resolved_recipe_is_the_config_and_checkpoint_and_encoder_become_model_artifacts(
        offline, tiny_recipe):
    """log_artifacts = ["checkpoint", "encoder"]: the run's newest checkpoint and RUN/encoder are
    logged as W&B model artifacts whose manifests list their files with the files' own digests."""
    import base64
    import hashlib

    tiny_recipe.write_text(tiny_recipe.read_text() + WANDB_LOGGER + 'log_artifacts = ["checkpoint", "encoder"]\n')
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=2"]) == 0
    run_dir, [folder] = run_folders(tiny_recipe)
    run = read_run(folder)
    [wandb_file] = folder.glob("run-*.wandb")
    found = list(records(wandb_file))
    config = {item.key: json.loads(item.value_json)
              for r in found if r.WhichOneof("record_type") == "run" for item in r.run.config.update}
    assert config["model"]["name"] == "vjepa3d" and config["run"]["max_steps"] == 2
    artifacts = {r.artifact.name: r.artifact for r in found if r.WhichOneof("record_type") == "artifact"}
    assert set(artifacts) == {f"checkpoint-{run['id']}", f"encoder-{run['id']}"}

    def digest(path: Path) -> str:
        return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()

    checkpoint = Path(json.loads((run_dir / "summary.json").read_text())["checkpoint"])
    encoder = artifacts[f"encoder-{run['id']}"]
    assert encoder.type == "model"
    assert {e.path: e.digest for e in encoder.manifest.contents} == {
        name: digest(run_dir / "encoder" / name) for name in ("README.md", "config.json", "model.safetensors")}
    assert {e.path: e.digest for e in artifacts[f"checkpoint-{run['id']}"].manifest.contents} == {
        checkpoint.name: digest(checkpoint)}


def test_log_artifacts_takes_only_what_it_knows(tiny_recipe, capsys):
    tiny_recipe.write_text(tiny_recipe.read_text() + WANDB_LOGGER + 'log_artifacts = ["weights"]\n')
    assert main(["show", str(tiny_recipe)]) == 2
    assert "log_artifacts" in capsys.readouterr().err


def test_wandb_s_own_lines_go_to_the_run_log_not_the_console(tiny_recipe, tmp_path):
    """W&B prints some 40 `wandb: ...` lines of its own (where the run is saved, the history and
    summary tables); in a real `octfw run` they land in octfw.log and the console keeps octfw's."""
    import os
    import subprocess

    tiny_recipe.write_text(tiny_recipe.read_text() + WANDB_LOGGER)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("WANDB_SILENT", None)  # W&B's default: it speaks
    out = subprocess.run([sys.executable, "-m", "octfw.cli", "run", str(tiny_recipe), "--set", "run.max_steps=2"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    console = (out.stdout + out.stderr).splitlines()
    assert console and not [line for line in console if line.startswith("wandb")]
    run_dir, [_folder] = run_folders(tiny_recipe)
    log = (run_dir / "octfw.log").read_text()
    assert "INFO     wandb [MainThread]: wandb: Tracking run with wandb version" in log
    assert "wandb: Run summary:" in log and "wandb: You can sync this run to the cloud" in log
