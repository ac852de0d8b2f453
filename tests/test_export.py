"""Encoder export: `octfw export` from a real run, and `octfw.load_encoder`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import octfw
from octfw.plugins.checkpointers.local import LocalCheckpointer
from octfw.cli.main import main
from octfw.exports.pretrained import PretrainedEncoder, load_encoder
from octfw.display.errors import UserError
from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build

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
                              "embed_dim": 96, "depth": 4, "num_heads": 3, "mlp_ratio": 4.0,
                              "standardise_input": True}  # so that embed standardises as training did
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


# --- overwriting, provenance and the model card ----------------------------------


@pytest.mark.parametrize("export_format", ["octfw", "torchscript", "safetensors", "monai-bundle"])
def test_every_format_refuses_to_overwrite_an_export_unless_force(run_dir, tmp_path, capsys, export_format):
    out = tmp_path / "encoder.pt"  # the name of the issue, for the folder formats too
    assert main(["export", str(run_dir), "--out", str(out), "--format", export_format]) == 0
    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(out), "--format", export_format]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: already exists; give --force to replace it" in err and len(err.strip().splitlines()) == 1
    # The file written last, which a replaced export writes anew.
    marker = {"safetensors": out / "config.json",
              "monai-bundle": out / "configs" / "metadata.json"}.get(export_format, out)
    before = marker.stat().st_mtime_ns
    assert main(["export", str(run_dir), "--out", str(out), "--format", export_format, "--force"]) == 0
    assert marker.stat().st_mtime_ns != before
    assert load_encoder(out).embed_dim == 96
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.pt"]  # no temporary left beside it


def test_force_never_replaces_a_folder_that_holds_no_export(run_dir, tmp_path, capsys):
    data = tmp_path / "scans"
    data.mkdir()
    (data / "a.dcm").write_bytes(b"a scan")
    assert main(["export", str(run_dir), "--out", str(data), "--format", "safetensors", "--force"]) == 2
    assert "--force replaces an earlier export only" in capsys.readouterr().err
    assert (data / "a.dcm").read_bytes() == b"a scan"


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory) -> Path:
    """A tiny run whose knn evaluator logged results at its last step."""
    root = tmp_path_factory.mktemp("evaluated")
    recipe = root / "tiny.toml"
    recipe.write_text(TINY_RECIPE + """
[[evaluator]]
name = "knn"
dataset = { name = "synthetic-oct", n_volumes = 24, labels = true, seed = 5 }
k = 3
bootstrap = 0
""", encoding="utf-8")
    assert main(["run", str(recipe), "--set", f"run.output_dir={root / 'runs'}", "--set", "run.max_steps=2"]) == 0
    return next((root / "runs" / "tiny").iterdir())


def exported_bytes(path: Path) -> dict[str, bytes]:
    """Every file under ``path``, and every member of the zip archives among them
    (torch.save and TorchScript files), by name."""
    import zipfile

    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    out = {}
    for file in files:
        out[str(file)] = file.read_bytes()
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as archive:
                out.update({f"{file}!{name}": archive.read(name) for name in archive.namelist()})
    return out


def test_no_exported_file_holds_a_local_path(evaluated_run, tmp_path):
    local = [str(evaluated_run.parents[2]), str(tmp_path), str(Path.home())]
    for export_format in ("octfw", "torchscript", "safetensors", "monai-bundle"):
        out = tmp_path / f"out-{export_format}"
        assert main(["export", str(evaluated_run), "--out", str(out), "--format", export_format]) == 0
        for name, data in exported_bytes(out).items():
            for path in local:
                assert path.encode() not in data, f"{name} holds {path}"
        info = load_encoder(out).info
        assert info["checkpoint"] == "step_00000002.pt" and info["update_step"] == 2
        assert info["run"] == f"tiny/{evaluated_run.name}"


def test_the_model_card_states_licence_datasets_and_the_runs_evaluator_results(evaluated_run, tmp_path):
    from huggingface_hub import ModelCard

    plain, given = tmp_path / "plain", tmp_path / "given"
    assert main(["export", str(evaluated_run), "--out", str(plain), "--format", "safetensors"]) == 0
    assert main(["export", str(evaluated_run), "--out", str(given), "--format", "safetensors",
                 "--license", "cc-by-nc-4.0", "--dataset", "org/oct-cohort", "--dataset", "site-b"]) == 0

    card = ModelCard.load(plain / "README.md")  # the Hub's own parser of the YAML front matter
    assert card.data.license == "other" and card.data.datasets == ["synthetic-oct"]
    logged = [json.loads(line) for line in (evaluated_run / "metrics.jsonl").read_text().splitlines()]
    [final] = [row for row in logged if "eval/knn/auroc" in row]
    results = {r.metric_type: r for r in card.data.eval_results}
    overall = {"accuracy", "balanced_accuracy", "auroc", "auprc"}
    # Overall only, no per-domain values: the mean reading and the token reading (issue #39).
    assert set(results) == overall | {f"tokens_{m}" for m in overall}
    assert results["auroc"].metric_value == pytest.approx(final["eval/knn/auroc"])
    assert results["auroc"].dataset_name == "synthetic-oct" and results["auroc"].task_type == "feature-extraction"
    assert card.data.metrics[:4] == ["accuracy", "balanced_accuracy", "auroc", "auprc"]
    assert set(card.data.metrics) == set(results)
    assert "| knn | auroc |" in card.text

    card = ModelCard.load(given / "README.md")
    assert card.data.license == "cc-by-nc-4.0" and card.data.datasets == ["org/oct-cohort", "site-b"]
    assert load_encoder(given).info["license"] == "cc-by-nc-4.0"


def test_a_run_without_evaluators_gets_a_card_with_honest_defaults(exported, tmp_path):
    encoder = load_encoder(exported)
    assert encoder.info["metrics"] == [] and encoder.info["license"] == "other"
    card = (encoder.save_pretrained(tmp_path / "hub") / "README.md").read_text()
    assert "metrics:" not in card and "model-index" not in card
    assert "No evaluator results were recorded" in card and "not stated at export" in card


def test_a_dataset_is_named_by_its_last_folder_never_its_local_path():
    from octfw.exports.formats import dataset_label, run_name

    assert dataset_label({"name": "synthetic-oct", "n_volumes": 8}) == "synthetic-oct"
    assert dataset_label({"name": "dicom", "path": "/data/site-a/manifest.jsonl"}) == "site-a"
    assert dataset_label({"name": "dicom", "path": "/data/oct/**/*.dcm"}) == "oct"
    assert dataset_label({"name": "prepared", "path": "gs://bucket/cohort-2026/"}) == "cohort-2026"
    assert run_name("/home/me/runs/tiny/20261126-134026Z/checkpoints/step_00000004.pt") == "tiny/20261126-134026Z"
    assert run_name("/home/me/step_00000004.pt") is None


def test_octfw_eval_takes_an_export_of_every_format(run_dir, exported, tmp_path):
    from octfw.evaluation.target import load_target
    from octfw.registry import load_registry

    registry = load_registry()
    reference = load_target(exported, 0, registry)
    volume = torch.randn(1, 1, *IMAGE, generator=torch.Generator().manual_seed(4))
    for export_format in ("torchscript", "safetensors", "monai-bundle"):
        out = tmp_path / export_format
        assert main(["export", str(run_dir), "--out", str(out), "--format", export_format]) == 0
        target = load_target(out, 0, registry)
        assert target.update_step == reference.update_step and target.recipe == reference.recipe
        with torch.no_grad():
            assert torch.equal(target.pretrained(volume), reference.pretrained(volume))
            assert torch.equal(target.random_init(volume), reference.random_init(volume))  # the same seeded baseline
