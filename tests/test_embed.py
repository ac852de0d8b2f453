"""Encoders take what users have: DICOM files, folders, arrays with a spacing; octfw embed writes a table.

A real tiny run is exported once; volumes are real DICOM files of the synthetic writer.
"""

from __future__ import annotations

import csv
import json
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
    """safetensors (a folder octfw and the safetensors library read) and TorchScript (run without
    octfw): each gives the eager encoder's patch tokens within 1e-5."""
    import subprocess
    import sys

    run_dir = next((exported.parent / "runs" / "tiny").iterdir())
    folder, script = tmp_path / "encoder-st", tmp_path / "encoder.ts"
    assert main(["export", str(run_dir), "--out", str(folder), "--format", "safetensors"]) == 0
    assert main(["export", str(run_dir), "--out", str(script), "--format", "torchscript"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]

    eager = load_encoder(exported)
    volume = torch.randn(2, 1, *eager.image_size, generator=torch.Generator().manual_seed(0))
    torch.save(volume, tmp_path / "volume.pt")
    with torch.no_grad():
        torch.save(eager(volume), tmp_path / "eager.pt")
    code = f"""
import sys, torch
volume, eager = torch.load({str(tmp_path / 'volume.pt')!r}), torch.load({str(tmp_path / 'eager.pt')!r})
script = torch.jit.load({str(script)!r})
torch.testing.assert_close(script(volume), eager, atol=1e-5, rtol=1e-5)
from safetensors.torch import load_file
assert len(load_file({str(folder / 'model.safetensors')!r})) > 0
assert "octfw" not in sys.modules, "TorchScript and safetensors load without octfw"
import octfw
with torch.no_grad():
    torch.testing.assert_close(octfw.load_encoder({str(folder)!r})(volume), eager, atol=1e-5, rtol=1e-5)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

    with pytest.raises(UserError, match="give a new or empty folder"):
        from octfw.api import export

        export(run_dir, folder, format="safetensors")
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match="needs config.json and model.safetensors"):
        load_encoder(folder)
