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

from octfw.cli.main import main
from octfw.dicom.decoding import read_oct_volume
from octfw.plugins.datasets.synthetic.cohort import write_synthetic_cohort
from octfw.exports.pretrained import load_encoder
from octfw.display.errors import UserError

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
from octfw.exports.pretrained import PretrainedEncoder
with torch.no_grad():
    torch.testing.assert_close(octfw.load_encoder({str(folder)!r})(volume), eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(PretrainedEncoder.from_pretrained("octfw/tiny-encoder")(volume), eager,
                               atol=1e-5, rtol=1e-5)
print("ok")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]

    with pytest.raises(UserError, match="already exists; give --force to replace it"):
        from octfw.api import export

        export(run_dir, folder, format="safetensors")
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match="needs config.json and model.safetensors"):
        load_encoder(folder)


def test_a_failed_folder_export_leaves_nothing(exported, tmp_path, monkeypatch):
    """The bundle is built beside --out and renamed when complete: a write that fails midway
    (here the model card, after the TorchScript file) leaves neither --out nor a temporary folder."""
    import octfw.exports.writing

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(octfw.exports.writing, "model_card", no_space)
    run_dir = next((exported.parent / "runs" / "tiny").iterdir())
    with pytest.raises(OSError, match="No space left"):
        from octfw.api import export

        export(run_dir, tmp_path / "bundle", format="monai-bundle")
    assert list(tmp_path.iterdir()) == []


def test_from_pretrained_names_a_repository_it_cannot_find(tmp_path, monkeypatch):
    from octfw.exports.pretrained import PretrainedEncoder

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

    from octfw.plugins.datasets.prepared.config import PreparedConfig
    from octfw.plugins.datasets.prepared.store import HEADER_FILE
    from octfw.plugins.datasets.vendor.config import OctVendorConfig
    from octfw.exports.volumes import open_volumes
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

    @attrs.frozen
    class ProbeVolumes:  # a dataset (octfw.types.Dataset) that only says where it reads
        path: str

        def __len__(self):
            return 0

        def load(self, index):
            raise IndexError(index)

        def domain(self, index):
            return "probe"

    class Probe:
        @hookimpl
        def octfw_register_datasets(self, register):
            register("probe-volumes", ProbeConfig, lambda config, ctx: ProbeVolumes(str(config.path)), "probe")

    module = types.ModuleType("plug_probe_volumes")
    module.plugin = Probe()
    monkeypatch.setitem(sys.modules, "plug_probe_volumes", module)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    entry_point = metadata.EntryPoint(name="plug_probe_volumes", value="plug_probe_volumes:plugin", group="octfw")
    registry = load_registry(entry_points=[entry_point])
    assert open_volumes(tmp_path / "eye.probe", registry) == ProbeVolumes(str(tmp_path / "eye.probe"))
    with pytest.raises(UserError, match="no DICOM files in"):  # without the prepared dataset: dicom
        open_volumes(tmp_path / "store", load_registry(builtins=["octfw.plugins.datasets.dicom"], entry_points=[]))
    (tmp_path / "eye.e2e.probe").mkdir()
    (tmp_path / "eye.e2e.probe" / HEADER_FILE).write_text("{}")
    with pytest.raises(UserError, match=r"several datasets recognise it \(prepared, probe-volumes\)"):
        open_volumes(tmp_path / "eye.e2e.probe", registry)


def test_octfw_embed_takes_every_export_format_as_its_encoder(exported, cohort, tmp_path, capsys):
    """The issue's case first: a TorchScript export named encoder.pt. Every format gives the
    same table as the octfw file, since each carries the same weights and [transform]."""
    run_dir = next((exported.parent / "runs" / "tiny").iterdir())
    data = str(good_files(cohort)[0])
    assert main(["embed", str(exported), data, "--out", str(tmp_path / "octfw.csv")]) == 0
    expected = (tmp_path / "octfw.csv").read_text()
    for export_format, name in [("torchscript", "encoder.pt"), ("safetensors", "st"), ("monai-bundle", "bundle")]:
        out = tmp_path / export_format / name
        out.parent.mkdir()
        assert main(["export", str(run_dir), "--out", str(out), "--format", export_format]) == 0
        table = tmp_path / f"{export_format}.csv"
        assert main(["embed", str(out), data, "--out", str(table)]) == 0, capsys.readouterr().err
        assert table.read_text() == expected, export_format


def test_a_file_that_is_no_octfw_export_is_refused_in_one_line_saying_what_to_give(exported, tmp_path):
    plain = tmp_path / "plain.pt"
    torch.jit.save(torch.jit.trace(torch.nn.Linear(2, 2), torch.zeros(1, 2)), str(plain))
    with pytest.raises(UserError, match=r"a TorchScript file without octfw's config.json; run it with "
                                        r"torch.jit.load, or give a file or folder written by `octfw export`"):
        load_encoder(plain)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(exported.read_bytes()[:4096])
    with pytest.raises(UserError, match="the file is cut short or not an encoder file$"):
        load_encoder(cut)


class LocalHub:
    """A stand-in for huggingface_hub.HfApi that keeps each upload as the Hub cache lays out
    a download (models--org--name/refs/main, snapshots/<commit>/), so from_pretrained reads it
    back offline. Each call is bound to the installed HfApi's signature: a renamed or removed
    argument fails here as it would against the Hub."""

    def __init__(self, cache: Path):
        self.cache, self.calls = cache, []

    def _check(self, name, *args, **kwargs):
        import inspect

        from huggingface_hub import HfApi

        inspect.signature(getattr(HfApi, name)).bind(HfApi(), *args, **kwargs)
        self.calls.append(name)

    def create_repo(self, *args, **kwargs):
        self._check("create_repo", *args, **kwargs)

    def upload_folder(self, *args, **kwargs):
        import hashlib
        import shutil

        self._check("upload_folder", *args, **kwargs)
        org, name = kwargs["repo_id"].split("/")
        repo = self.cache / f"models--{org}--{name}"
        folder = Path(kwargs["folder_path"])
        commit = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(folder.iterdir()))).hexdigest()
        shutil.copytree(folder, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / (kwargs.get("revision") or "main")).write_text(commit)
        return f"https://huggingface.co/{kwargs['repo_id']}/commit/{commit}"


def test_push_to_hub_uploads_what_from_pretrained_reads_back(exported, tmp_path):
    from octfw.exports.pretrained import PretrainedEncoder

    encoder = load_encoder(exported)
    hub = LocalHub(tmp_path / "hub-cache")
    url = encoder.push_to_hub("octfw/pushed-encoder", private=True, api=hub)
    assert hub.calls == ["create_repo", "upload_folder"]
    assert url.startswith("https://huggingface.co/octfw/pushed-encoder/commit/")
    [snapshot] = (tmp_path / "hub-cache" / "models--octfw--pushed-encoder" / "snapshots").iterdir()
    assert sorted(p.name for p in snapshot.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert str(tmp_path).encode() not in b"".join(p.read_bytes() for p in snapshot.iterdir())

    pulled = PretrainedEncoder.from_pretrained("octfw/pushed-encoder", cache_dir=str(tmp_path / "hub-cache"),
                                               local_files_only=True)
    volume = torch.randn(1, 1, *encoder.image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(pulled(volume), encoder(volume))
    assert pulled.info["checkpoint"] == encoder.info["checkpoint"]


def test_push_to_hub_says_in_one_line_why_an_upload_failed(exported):
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    class Refusing:
        def create_repo(self, *args, **kwargs):
            url = "https://huggingface.co/api/repos/create"
            response = httpx.Response(401, request=httpx.Request("POST", url))
            raise HfHubHTTPError(f"401 Client Error: Unauthorized for url: {url}", response=response)

    with pytest.raises(UserError, match=r"push_to_hub: octfw/x: the upload failed \(HfHubHTTPError: 401 Client"):
        load_encoder(exported).push_to_hub("octfw/x", api=Refusing())


BUNDLE_CHECK = """
import sys, numpy, torch
from monai.bundle import ConfigParser

bundle, inputs, expected = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
parser = ConfigParser()
parser.read_config(bundle + "/configs/inference.json")
parser["bundle_root"] = bundle
network = parser.get_parsed_content("network_def")  # the class in scripts/vit3d.py, built without octfw
network.load_state_dict(torch.load(bundle + "/models/model.pt", weights_only=True))  # strict: every weight
network.train()  # one fine-tuning step's backward pass reaches every weight
network(torch.zeros(1, parser["network_def"]["in_channels"], *parser["network_def"]["image_size"])).mean().backward()
assert all(p.grad is not None for p in network.parameters())
network.load_state_dict(torch.load(bundle + "/models/model.pt", weights_only=True))
network.eval()
for path, want in zip(inputs, numpy.load(expected)):
    parser["input_path"] = path
    image = parser.get_parsed_content("image", lazy=False)  # LoadImage: [1, D, H, W]
    prepared = parser.get_parsed_content("preprocessing", lazy=True)(image)
    with torch.no_grad():
        tokens = network(torch.as_tensor(prepared).as_subclass(torch.Tensor)[None])
    numpy.testing.assert_allclose(tokens[0].numpy(), want, atol=1e-5, rtol=1e-5)
assert "octfw" not in sys.modules
print("ok", len(inputs))
"""


def bundle_check(bundle: Path, inputs: list[Path], expected: np.ndarray, tmp_path: Path) -> None:
    """Run BUNDLE_CHECK in a fresh process (no octfw on its path): each input, read and prepared
    by the bundle's config, gives the expected tokens through its network and model.pt."""
    import subprocess
    import sys

    np.save(tmp_path / "expected.npy", expected)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", BUNDLE_CHECK, str(bundle), *map(str, inputs),
                             str(tmp_path / "expected.npy")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"ok {len(inputs)}", result.stderr[-3000:]


def test_the_monai_bundle_reads_dicom_and_npy_and_ships_a_network_to_fine_tune(exported, cohort, tmp_path):
    """MONAI's ConfigParser, offline and without octfw: LoadImage reads a real DICOM file of the
    synthetic writer and a .npy array, the bundle's preprocessing prepares them, and network_def
    with models/model.pt gives octfw's own tokens of the same volumes."""
    run_dir = next((exported.parent / "runs" / "tiny").iterdir())
    bundle = tmp_path / "bundle"
    assert main(["export", str(run_dir), "--out", str(bundle), "--format", "monai-bundle"]) == 0
    encoder = load_encoder(exported)
    dicom = good_files(cohort)[0]
    sample = read_oct_volume(str(dicom))
    np.save(tmp_path / "volume.npy", sample.volume)
    expected = torch.cat([encoder.embed(dicom), encoder.embed(sample.volume, sample.provenance.spacing)])
    bundle_check(bundle, [dicom, tmp_path / "volume.npy"], expected.numpy(), tmp_path)


def test_the_monai_bundle_reads_nifti(exported, cohort, tmp_path):
    nibabel = pytest.importorskip("nibabel")  # MONAI's NIfTI reader needs it; not in octfw's lock
    run_dir = next((exported.parent / "runs" / "tiny").iterdir())
    bundle = tmp_path / "bundle"
    assert main(["export", str(run_dir), "--out", str(bundle), "--format", "monai-bundle"]) == 0
    sample = read_oct_volume(str(good_files(cohort)[0]))
    nibabel.save(nibabel.Nifti1Image(sample.volume, np.eye(4)), str(tmp_path / "volume.nii.gz"))
    expected = load_encoder(exported).embed(sample.volume, sample.provenance.spacing)
    bundle_check(bundle, [tmp_path / "volume.nii.gz"], expected.numpy(), tmp_path)
