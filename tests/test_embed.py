"""Encoders take what users have: DICOM files, folders, arrays with a spacing; octfw embed writes a table.

A real tiny run is exported once; volumes are real DICOM files of the synthetic writer.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from octfw.cli import main
from octfw.data.dicom.reader import read_oct_volume
from octfw.data.synthetic.cohort import write_synthetic_cohort
from octfw.encoder import load_encoder
from octfw.errors import UserError

from conftest import TINY_RECIPE

SHAPES = {"heidelberg": (6, 40, 32), "topcon": (5, 36, 36), "zeiss": (7, 32, 40)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("embed")
    recipe = root / "tiny.toml"
    recipe.write_text(TINY_RECIPE, encoding="utf-8")
    assert main(["run", str(recipe), "--set", "run.max_steps=2"]) == 0
    [run_dir] = (root / "runs" / "tiny").iterdir()
    assert main(["export", str(run_dir), "--out", str(root / "encoder.pt")]) == 0
    return root / "encoder.pt"


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cohort")
    write_synthetic_cohort(folder, 6, shapes=SHAPES, seed=2, corrupt_fraction=0.34, with_labels=True)
    return folder


def good_files(cohort: Path) -> list[Path]:
    rows = [json.loads(line) for line in (cohort / "manifest.jsonl").read_text().splitlines()]
    usable = []
    for row in rows:
        path = cohort / row["path"] if not Path(row["path"]).is_absolute() else Path(row["path"])
        try:
            read_oct_volume(str(path))
        except Exception:  # noqa: BLE001 - the corrupt ones
            continue
        usable.append(path)
    return usable


def test_a_dicom_file_and_the_same_array_with_its_spacing_embed_alike(exported, cohort):
    encoder = load_encoder(exported)
    path = good_files(cohort)[0]
    from_file = encoder.embed(path, pooled=True)
    assert from_file.shape == (1, encoder.embed_dim)

    sample = read_oct_volume(str(path))
    from_array = encoder.embed(sample.volume, spacing=sample.provenance.spacing, pooled=True)
    torch.testing.assert_close(from_array, from_file)
    # The same as preparing by hand with the exported transform and pooling the tokens.
    by_hand = encoder.pool(torch.from_numpy(encoder.prepare(sample))[None])
    torch.testing.assert_close(by_hand.detach(), from_file)

    both = encoder.embed([path, torch.from_numpy(sample.volume)], spacing=sample.provenance.spacing, pooled=True)
    torch.testing.assert_close(both[0], both[1])
    tokens = encoder.embed(path)
    assert tokens.shape == (1, int(np.prod(encoder.grid_size)), encoder.embed_dim)
    # A prepared [B, C, D, H, W] batch is taken as it is: the tokens a pretraining model's embed gives.
    prepared = torch.from_numpy(encoder.prepare(sample))[None]
    torch.testing.assert_close(encoder.embed(prepared), tokens)


def test_what_cannot_be_embedded_is_one_clear_error(exported, cohort, tmp_path):
    encoder = load_encoder(exported)
    volume = read_oct_volume(str(good_files(cohort)[0])).volume
    with pytest.raises(UserError, match=r"needs spacing=\(dz, dy, dx\)"):
        encoder.embed(volume)
    with pytest.raises(UserError, match=r"expected a volume \[D, H, W\]"):
        encoder.embed(volume[0], spacing=(1, 1, 1))
    broken = tmp_path / "broken.dcm"
    broken.write_bytes(b"not a DICOM file at all")
    with pytest.raises(UserError, match="embed: .*broken.dcm"):
        encoder.embed(broken)


def test_octfw_embed_writes_a_table_and_lists_the_files_it_could_not_use(exported, cohort, tmp_path, capsys):
    out = tmp_path / "embeddings.csv"
    assert main(["embed", str(exported), str(cohort / "manifest.jsonl"), "--out", str(out)]) == 0
    with out.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    encoder = load_encoder(exported)
    usable = good_files(cohort)
    assert len(rows) == len(usable) == 4
    assert list(rows[0])[:4] == ["source", "domain", "label", "e0"] and f"e{encoder.embed_dim - 1}" in rows[0]
    assert {row["label"] for row in rows} <= {"0", "1"}
    first = np.array([float(rows[0][f"e{i}"]) for i in range(encoder.embed_dim)], dtype=np.float32)
    np.testing.assert_allclose(first, encoder.embed(rows[0]["source"], pooled=True)[0].numpy(), rtol=1e-5, atol=1e-6)
    quarantine = [json.loads(line) for line in Path(str(out) + ".quarantine.jsonl").read_text().splitlines()]
    assert len(quarantine) == 2 and all(q["reason"] for q in quarantine)
    assert "embedded  4 volumes" in capsys.readouterr().out


def test_every_export_format_loads_in_a_fresh_process_and_embeds_like_the_eager_encoder(exported, tmp_path):
    """Each format, loaded in a fresh process, gives the eager encoder's patch tokens within 1e-5:
    TorchScript (run without octfw), safetensors (the Hub layout: read by the safetensors library
    without octfw, by octfw.load_encoder, and by PretrainedEncoder.from_pretrained from a Hugging
    Face cache with HF_HUB_OFFLINE=1), and a MONAI bundle that monai.bundle runs without octfw on a
    raw [D, H, W] volume, preparing it as octfw's transform does."""
    import subprocess
    import sys

    run_dir = next((exported.parent / "runs" / "tiny").iterdir())
    folder, script, bundle = tmp_path / "encoder-st", tmp_path / "encoder.ts", tmp_path / "bundle"
    assert main(["export", str(run_dir), "--out", str(folder), "--format", "safetensors"]) == 0
    assert main(["export", str(run_dir), "--out", str(script), "--format", "torchscript"]) == 0
    assert main(["export", str(run_dir), "--out", str(bundle), "--format", "monai-bundle"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert "feature-extraction" in (folder / "README.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    # The Hugging Face cache layout, as huggingface_hub.snapshot_download leaves a repository.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-cache" / "models--octfw--tiny-encoder"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    eager = load_encoder(exported)
    assert eager.save_pretrained(snapshot) == snapshot

    volume = torch.randn(2, 1, *eager.image_size, generator=torch.Generator().manual_seed(0))
    raw = np.random.default_rng(0).gamma(2.0, 30.0, size=(10, 40, 36)).astype(np.float32)
    np.save(tmp_path / "raw.npy", raw)
    spacing = eager.info["transform"].get("target_spacing") or (0.1, 0.02, 0.02)
    torch.save(volume, tmp_path / "volume.pt")
    with torch.no_grad():
        torch.save(eager(volume), tmp_path / "eager.pt")
    np.save(tmp_path / "eager_raw.npy", eager.embed(raw, spacing).numpy())
    code = f"""
import sys, numpy, torch
volume, eager = torch.load({str(tmp_path / 'volume.pt')!r}), torch.load({str(tmp_path / 'eager.pt')!r})
script = torch.jit.load({str(script)!r})
torch.testing.assert_close(script(volume), eager, atol=1e-5, rtol=1e-5)
from safetensors.torch import load_file
assert len(load_file({str(folder / 'model.safetensors')!r})) > 0
from monai.bundle import run
run(config_file={str(bundle / 'configs' / 'inference.json')!r}, meta_file={str(bundle / 'configs' / 'metadata.json')!r},
    bundle_root={str(bundle)!r}, input_path={str(tmp_path / 'raw.npy')!r}, output_path={str(tmp_path / 'bundle.npy')!r})
numpy.testing.assert_allclose(numpy.load({str(tmp_path / 'bundle.npy')!r}),
                              numpy.load({str(tmp_path / 'eager_raw.npy')!r}), atol=1e-5, rtol=1e-5)
assert "octfw" not in sys.modules, "TorchScript, safetensors and the MONAI bundle run without octfw"
import octfw
from octfw.encoder import PretrainedEncoder
with torch.no_grad():
    torch.testing.assert_close(octfw.load_encoder({str(folder)!r})(volume), eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(PretrainedEncoder.from_pretrained("octfw/tiny-encoder")(volume), eager,
                               atol=1e-5, rtol=1e-5)
print("ok")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]

    with pytest.raises(UserError, match="give a new or empty folder"):
        from octfw.api import export

        export(run_dir, folder, format="safetensors")
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match="needs config.json and model.safetensors"):
        load_encoder(folder)


def test_a_failed_folder_export_leaves_nothing(exported, tmp_path, monkeypatch):
    """The bundle is built beside --out and renamed when complete: a write that fails midway
    (here the model card, after the TorchScript file) leaves neither --out nor a temporary folder."""
    import octfw.formats

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(octfw.formats, "model_card", no_space)
    run_dir = next((exported.parent / "runs" / "tiny").iterdir())
    with pytest.raises(OSError, match="No space left"):
        from octfw.api import export

        export(run_dir, tmp_path / "bundle", format="monai-bundle")
    assert list(tmp_path.iterdir()) == []


def test_from_pretrained_names_a_repository_it_cannot_find(tmp_path, monkeypatch):
    from octfw.encoder import PretrainedEncoder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="octfw/missing: no such folder, and not found on the Hugging Face Hub"):
        PretrainedEncoder.from_pretrained("octfw/missing")


def test_a_location_is_opened_by_the_dataset_whose_config_recognises_it(tmp_path, monkeypatch):
    """open_volumes asks each dataset's config (RecognisingDatasetConfig), a third party's too; none: dicom."""
    import importlib.metadata as metadata
    import sys
    import types

    import attrs
    import fsspec

    from octfw.data.prepared.config import PreparedConfig
    from octfw.data.prepared.store import HEADER_FILE
    from octfw.data.vendor.config import OctVendorConfig
    from octfw.encoder import open_volumes
    from octfw.hookspecs import hookimpl
    from octfw.registry import DISABLE_ENV, load_registry

    fs = fsspec.filesystem("file")
    (tmp_path / "store").mkdir()
    assert not PreparedConfig.recognises(fs, str(tmp_path / "store"))
    (tmp_path / "store" / HEADER_FILE).write_text("{}")
    assert PreparedConfig.recognises(fs, str(tmp_path / "store"))
    assert OctVendorConfig.recognises(fs, "bucket/scans/eye.E2E")
    assert not OctVendorConfig.recognises(fs, "bucket/scans/eye.dcm")

    @attrs.frozen
    class ProbeConfig:
        path: str

        @classmethod
        def recognises(cls, fs, path: str) -> bool:
            return path.endswith(".probe")

    class Probe:
        @hookimpl
        def octfw_register_datasets(self, register):
            register("probe-volumes", ProbeConfig, lambda config, ctx: ("probe", str(config.path)), "probe")

    module = types.ModuleType("plug_probe_volumes")
    module.plugin = Probe()
    monkeypatch.setitem(sys.modules, "plug_probe_volumes", module)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    entry_point = metadata.EntryPoint(name="plug_probe_volumes", value="plug_probe_volumes:plugin", group="octfw")
    registry = load_registry(entry_points=[entry_point])
    assert open_volumes(tmp_path / "eye.probe", registry) == ("probe", str(tmp_path / "eye.probe"))
    with pytest.raises(UserError, match="no DICOM files in"):  # without the prepared dataset: dicom
        open_volumes(tmp_path / "store", load_registry(builtins=["octfw.data.dicom"], entry_points=[]))
    (tmp_path / "eye.e2e.probe").mkdir()
    (tmp_path / "eye.e2e.probe" / HEADER_FILE).write_text("{}")
    with pytest.raises(UserError, match=r"several datasets recognise it \(prepared, probe-volumes\)"):
        open_volumes(tmp_path / "eye.e2e.probe", registry)
