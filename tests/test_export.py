"""Encoder export: `octfw export` from a real run, and `octfw.load_encoder`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import octfw
from octfw.checkpointers.local import LocalCheckpointer
from octfw.cli import main
from octfw.encoder import PretrainedEncoder, load_encoder
from octfw.errors import UserError
from octfw.models.vjepa3d import VJEPA3DConfig, build

from conftest import TINY_RECIPE
from test_vjepa3d import make_ctx

IMAGE = (8, 32, 32)  # TINY_RECIPE's transform.image_size
PATCH = (4, 16, 16)  # TINY_RECIPE's model.patch_size


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run of the tiny recipe, trained a few steps through the CLI."""
    root = tmp_path_factory.mktemp("export")
    recipe = root / "tiny.toml"
    recipe.write_text(TINY_RECIPE, encoding="utf-8")
    assert main(["run", str(recipe), "--set", f"run.output_dir={root / 'runs'}"]) == 0
    return next((root / "runs" / "tiny").iterdir())


def checkpoint_of(run_dir: Path) -> Path:
    return Path(LocalCheckpointer(run_dir / "checkpoints").latest())


def trained_model(run_dir: Path):
    """The training model rebuilt by hand from the run's checkpoint."""
    state = torch.load(checkpoint_of(run_dir), weights_only=True)
    model = build(VJEPA3DConfig(preset="tiny", patch_size=PATCH), make_ctx(IMAGE))
    model.load_state_dict(state["model"])
    return model.eval()


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("encoder") / "encoder.pt"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    return out


def test_export_from_a_run_embeds_bitwise_like_the_trained_model(run_dir, exported):
    encoder = load_encoder(exported)
    model = trained_model(run_dir)
    volume = torch.randn(2, 1, *IMAGE, generator=torch.Generator().manual_seed(3))
    tokens = encoder(volume)
    expected = model.embed(volume)
    assert tokens.shape == (2, model.num_patches, 96)
    assert torch.equal(tokens, expected)
    assert torch.equal(encoder.pool(volume), expected.mean(dim=1))


def test_the_exported_encoder_is_the_target_not_the_context_encoder(run_dir, exported):
    model = trained_model(run_dir)
    weights = torch.load(exported, weights_only=True)["state_dict"]
    target, context = model.target_encoder.state_dict(), model.context_encoder.state_dict()
    assert weights.keys() == target.keys()
    assert all(torch.equal(weights[k], target[k]) for k in target)
    # After a few updates with EMA momentum < 1 the two encoders differ.
    assert not all(torch.equal(weights[k], context[k]) for k in context)


def test_export_file_records_how_to_rebuild_and_prepare_inputs(exported):
    data = torch.load(exported, weights_only=True)  # plain data only
    assert data["format"] == "octfw-encoder" and data["architecture"] == "vit3d"
    assert data["octfw_version"] == octfw.__version__
    assert data["config"] == {"image_size": list(IMAGE), "patch_size": list(PATCH), "in_channels": 1,
                              "embed_dim": 96, "depth": 4, "num_heads": 3, "mlp_ratio": 4.0}
    assert data["transform"]["name"] == "oct-standard"
    assert data["transform"]["image_size"] == list(IMAGE)
    assert data["transform"]["percentiles"] == [1.0, 99.0]
    assert data["update_step"] == 4 and data["checkpoint"].endswith("step_00000004.pt")


def test_loaded_encoder_is_an_eval_module_with_its_geometry(exported):
    encoder = load_encoder(exported)
    assert isinstance(encoder, PretrainedEncoder) and not encoder.training
    assert encoder.image_size == IMAGE and encoder.patch_size == PATCH and encoder.embed_dim == 96
    assert encoder.info["transform"]["name"] == "oct-standard" and "state_dict" not in encoder.info
    with pytest.raises(ValueError, match=r"\[B, 1, 8, 32, 32\]"):
        encoder(torch.zeros(1, 1, 8, 32, 16))


def test_export_from_a_checkpoint_file_gives_the_same_weights(run_dir, exported, tmp_path):
    out = tmp_path / "from_file.pt"
    assert main(["export", str(checkpoint_of(run_dir)), "--out", str(out)]) == 0
    a = torch.load(exported, weights_only=True)["state_dict"]
    b = torch.load(out, weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_encoder_is_a_lazy_attribute_of_octfw():
    assert octfw.load_encoder is load_encoder
    code = "import sys, octfw; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- mistakes --------------------------------------------------------------------


def test_a_missing_path_exits_2(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "e.pt")]) == 2
    assert "no such run folder or checkpoint file" in capsys.readouterr().err


def test_a_folder_that_is_not_a_run_exits_2(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "e.pt")]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_a_run_without_checkpoints_exits_2(run_dir, tmp_path, capsys):
    empty_run = tmp_path / "run"
    empty_run.mkdir()
    shutil.copy(run_dir / "recipe.toml", empty_run / "recipe.toml")
    assert main(["export", str(empty_run), "--out", str(tmp_path / "e.pt")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_a_file_that_is_not_a_checkpoint_exits_2(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir / "recipe.toml"), "--out", str(tmp_path / "e.pt")]) == 2
    assert "recipe.toml" in capsys.readouterr().err
    stranger = tmp_path / "stranger.pt"
    torch.save({"weights": torch.zeros(3)}, stranger)
    assert main(["export", str(stranger), "--out", str(tmp_path / "e.pt")]) == 2
    assert "not an octfw training checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "e.pt").exists()


def test_an_output_folder_that_does_not_exist_exits_2(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "--out", str(tmp_path / "no" / "e.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_load_encoder_refuses_missing_files_and_checkpoints(run_dir, tmp_path):
    with pytest.raises(UserError, match="no such encoder file"):
        load_encoder(tmp_path / "missing.pt")
    with pytest.raises(UserError, match="not an octfw encoder file"):
        load_encoder(checkpoint_of(run_dir))
