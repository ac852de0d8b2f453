"""Dense evaluation (#39 item 4): finding masks in the data, prepared with their volumes, and the
``dense-probe`` evaluator's Dice and IoU at token and voxel resolution.

Masks are real files (.npy, NIfTI through nibabel, a DICOM Segmentation written with pydicom)
beside real DICOM volumes listed by a manifest; the probe runs on phantom-oct cohorts with a
randomly initialised tiny encoder (16 x 64 x 64 volumes in 4 x 16 x 16 patches: 64 tokens).
"""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from octfw.cli.main import main
from octfw.display.errors import ContractError, CorruptFile, UserError
from octfw.exports.formats import encoder_info
from octfw.exports.writing import write_export
from octfw.models.vit3d import ViT3DEncoder
from octfw.dicom.dataset import DicomDataset
from octfw.dicom.manifest import ManifestRow, read_manifest, write_manifest
from octfw.dicom.masks import SEGMENTATION_SOP_CLASS, read_finding_mask
from octfw.dicom.writing import write_oct_dicom
from octfw.registry import load_registry
from octfw.types import BuildContext, MaskedDataset, MaskPreparingTransform

IMAGE, PATCH = (16, 64, 64), (4, 16, 16)
SHAPE = (6, 20, 24)  # [D, H, W] of the hand-made volumes: every side different


def _box_mask(shape=SHAPE) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[1:4, 5:12, 3:9] = True  # asymmetric, so a transposed read would not match
    return mask


def _volume(mask: np.ndarray, seed: int = 0) -> np.ndarray:
    """uint16 noise, bright where ``mask`` is."""
    rng = np.random.default_rng(seed)
    return (rng.integers(1000, 2000, mask.shape) + 20000 * mask).astype(np.uint16)


def _write_nifti(path: Path, mask: np.ndarray, *, reverse: bool = True) -> None:
    import nibabel

    data = mask.transpose(2, 1, 0) if reverse else mask  # (i, j, k) = (W, H, D), as ITK writes it
    nibabel.save(nibabel.Nifti1Image(data.astype(np.uint8), np.eye(4)), str(path))


def _write_seg(path: Path, mask: np.ndarray, *, segments: int = 1) -> None:
    """A DICOM Segmentation (BINARY, one bit per pixel) of ``mask``'s B-scans, as pydicom writes it."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.pixels import pack_bits
    from pydicom.sequence import Sequence
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SEGMENTATION_SOP_CLASS
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = SEGMENTATION_SOP_CLASS, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.SegmentationType = "SEG", "BINARY"
    ds.SeriesInstanceUID, ds.StudyInstanceUID = generate_uid(), generate_uid()
    described = []
    for number in range(1, segments + 1):
        segment = Dataset()
        segment.SegmentNumber, segment.SegmentLabel = number, f"finding {number}"
        segment.SegmentAlgorithmType = "MANUAL"
        described.append(segment)
    ds.SegmentSequence = Sequence(described)
    ds.NumberOfFrames, ds.Rows, ds.Columns = mask.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 1, 1, 0, 0
    ds.PixelData = pack_bits(mask.astype(np.uint8))
    ds.save_as(str(path), enforce_file_format=True)


# --- reading masks -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["m.npy", "m.nii", "m.nii.gz", "m.seg.dcm", "m-without-suffix"])
def test_a_mask_reads_back_as_the_volumes_d_h_w_from_each_format(tmp_path, name):
    mask, path = _box_mask(), tmp_path / name
    if name.endswith(".npy"):
        np.save(path, mask)
    elif ".nii" in name:
        _write_nifti(path, mask)
    else:
        _write_seg(path, mask)  # a SEG is DICOM whatever its name
    read = read_finding_mask(str(path))
    assert read.dtype == bool and read.shape == SHAPE and (read == mask).all()


def test_a_mask_that_is_not_binary_missing_or_not_a_segmentation_names_its_file(tmp_path):
    np.save(tmp_path / "labels.npy", np.full(SHAPE, 2, dtype=np.uint8))
    write_oct_dicom(tmp_path / "image.dcm", _volume(_box_mask()), (0.2, 0.01, 0.02), "acme", "x")
    _write_seg(tmp_path / "two.dcm", _box_mask(), segments=2)
    (tmp_path / "junk.nii").write_bytes(b"not a nifti header")
    cases = {"labels.npy": "must be binary (0 or 1), found values [2]", "absent.npy": "mask file not found",
             "image.dcm": "must be a Segmentation", "two.dcm": "holds 2 segments; a finding mask has one",
             "junk.nii": "not a NIfTI-1 or NIfTI-2 image"}
    for name, reason in cases.items():
        with pytest.raises(CorruptFile) as info:
            read_finding_mask(str(tmp_path / name))
        assert info.value.url == str(tmp_path / name) and reason in info.value.reason, name


def _cohort(tmp_path: Path, masks: dict[int, str | None] | None = None, n: int = 4) -> Path:
    """``n`` DICOM volumes (two per patient), each with a .npy mask of its shape unless
    ``masks`` says otherwise (a file name relative to the folder, or None: no mask)."""
    rows = []
    for index in range(n):
        mask = _box_mask() if index % 2 else np.zeros(SHAPE, dtype=bool)
        dcm = write_oct_dicom(tmp_path / f"v{index}.dcm", _volume(mask, index), (0.2, 0.01, 0.02), "acme", "x")
        np.save(tmp_path / f"v{index}.mask.npy", mask)
        name = (masks or {}).get(index, f"v{index}.mask.npy")
        rows.append(ManifestRow(path=dcm, patient=f"p{index // 2}",
                                mask=None if name is None else str(tmp_path / name)))
    write_manifest(str(tmp_path / "cohort.jsonl"), rows)
    return tmp_path / "cohort.jsonl"


def test_the_manifest_mask_column_is_relative_to_the_manifest_and_read_by_the_dataset(tmp_path):
    manifest = _cohort(tmp_path)
    assert '"mask": "v1.mask.npy"' in manifest.read_text()  # written relative, like path
    assert [row.mask for row in read_manifest(str(manifest))] == [str(tmp_path / f"v{i}.mask.npy") for i in range(4)]
    dataset = DicomDataset.from_location(str(manifest))
    assert isinstance(dataset, MaskedDataset)
    assert dataset.mask_source(1) == str(tmp_path / "v1.mask.npy")
    assert (dataset.mask(1) == _box_mask()).all() and not dataset.mask(0).any()
    # Without a mask column: no mask, and the manifest is written as before (no "mask" key).
    write_manifest(str(tmp_path / "plain.jsonl"), [ManifestRow(path=str(tmp_path / "v0.dcm"))])
    assert "mask" not in (tmp_path / "plain.jsonl").read_text()
    assert DicomDataset.from_location(str(tmp_path / "plain.jsonl")).mask(0) is None


# --- preparing masks with their volumes ----------------------------------------------------------


def _transform(**options):
    registry = load_registry(entry_points=[])
    component = registry.get("transform", "oct-standard")
    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0, patch_size=(2, 4, 4))
    return component.build(component.config(image_size=[8, 16, 16], **options), ctx)


@pytest.mark.parametrize("options", [{}, {"fit": "crop_pad"}, {"target_spacing": [0.1, 0.02, 0.02]}])
def test_a_prepared_mask_covers_the_bright_voxels_of_its_prepared_volume(tmp_path, options):
    transform = _transform(**options)
    assert isinstance(transform, MaskPreparingTransform)
    mask = _box_mask()
    write_oct_dicom(tmp_path / "v.dcm", _volume(mask), (0.2, 0.01, 0.02), "acme", "x")
    sample = DicomDataset.from_location(str(tmp_path / "v.dcm")).load(0)
    volume, prepared = transform.prepare(sample), transform.prepare_mask(mask, sample)
    assert prepared.dtype == bool and prepared.shape == volume.shape == (8, 16, 16)
    assert prepared.any()
    # Resampled and fitted the same way: the mask's voxels are the bright ones.
    assert volume[prepared].min() > 0.5 > volume[~prepared].mean()
    with pytest.raises(ContractError, match=r"finding mask of shape \[20, 6, 24\] for a volume of shape"):
        transform.prepare_mask(mask.transpose(1, 0, 2), sample)


# --- the evaluator: masks refused in one line ------------------------------------------------


def _ctx(tmp_path: Path) -> BuildContext:
    registry = load_registry(entry_points=[])
    return BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path / "cache", run_dir=None, seed=0,
                        image_size=IMAGE, patch_size=PATCH, registry=registry,
                        recipe={"transform": {"name": "oct-standard", "image_size": list(IMAGE)}})


def _dense(tmp_path: Path, dataset: dict, **options):
    ctx = _ctx(tmp_path)
    component = ctx.registry.get("evaluator", "dense-probe")
    return component.build(component.config(dataset=dataset, **options), ctx)


def test_a_dataset_without_masks_is_refused_at_build_in_one_line(tmp_path):
    with pytest.raises(UserError) as info:
        _dense(tmp_path, {"name": "synthetic-oct", "n_volumes": 4})
    assert str(info.value).startswith("evaluator dense-probe: dataset: the dataset has no finding masks; use a "
                                      "manifest with a mask column")
    manifest = _cohort(tmp_path, masks={2: None})
    with pytest.raises(UserError, match=r"1 of 4 volumes have no finding mask \(first: .*v2\.dcm\)"):
        _dense(tmp_path, {"name": "dicom", "path": str(manifest)})


def test_a_mask_of_the_wrong_shape_or_unreadable_is_refused_naming_its_file(tmp_path):
    np.save(tmp_path / "small.npy", np.zeros((6, 20, 23), dtype=bool))
    _write_nifti(tmp_path / "raw.nii.gz", _box_mask(), reverse=False)  # written [D, H, W] as numpy holds it
    np.save(tmp_path / "labels.npy", np.full(SHAPE, 3, dtype=np.uint8))
    cases = {"small.npy": r"small\.npy: the finding mask has shape \[6, 20, 23\], its volume \[6, 20, 24\]$",
             "raw.nii.gz": r"raw\.nii\.gz: the finding mask has shape \[24, 20, 6\], its volume \[6, 20, 24\] "
                           r"\(reversed: a NIfTI mask's array is indexed \(x, y, z\) = \(W, H, D\)",
             "labels.npy": r"labels\.npy: a finding mask must be binary"}
    for name, message in cases.items():
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        (folder / name).write_bytes((tmp_path / name).read_bytes())
        evaluator = _dense(folder, {"name": "dicom", "path": str(_cohort(folder, masks={1: name}))})
        with pytest.raises(UserError, match=message) as info:
            evaluator.split()
        assert "\n" not in str(info.value) and str(folder / name) in str(info.value)


# --- the evaluator: Dice above an all-background predictor ----------------------------------


def _encoder(seed: int = 0) -> ViT3DEncoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ViT3DEncoder(IMAGE, PATCH, 1, 32, 2, 2, 2.0)


@pytest.mark.parametrize("family", ["tuning", "held-out"])
def test_the_probe_finds_the_phantom_finding_at_voxel_and_token_resolution(tmp_path, family):
    """A random-init encoder's tokens still say where a patch is bright or dark: an all-background
    predictor scores Dice 0, the probe clearly more, frozen and fine-tuned, split by patient."""
    evaluator = _dense(tmp_path, {"name": "phantom-oct", "family": family, "n_volumes": 36, "seed": 1},
                       bootstrap=200, epochs=30, fine_tune_epochs=3)
    train, test = evaluator.split()
    assert not {g for g in train.groups} & {g for g in test.groups}  # no patient on both sides
    assert train.labels.any() and test.labels.any() and not test.labels.all()
    with torch.no_grad():  # as the engine calls it
        scores = evaluator.evaluate(_encoder(), torch.device("cpu"), 0)
    for prefix in ("", "fine_tune_"):
        for resolution in ("voxel", "token"):
            dice, iou = scores[f"{prefix}{resolution}_dice"], scores[f"{prefix}{resolution}_iou"]
            # An all-background predictor scores 0; a random encoder's voxel reading measured 0.08-0.18.
            assert dice > (0.05 if resolution == "voxel" else 0.1) and 0 < iou < dice, (prefix, resolution, dice)
            low, high = scores[f"{prefix}{resolution}_dice_ci_low"], scores[f"{prefix}{resolution}_dice_ci_high"]
            assert low <= dice <= high and high - low < 0.5
    assert any(key.startswith("voxel_dice/") for key in scores)  # per domain too
    assert scores["fine_tune_trained_parameters"] > scores["trained_parameters"]


def test_dice_and_iou_are_pooled_and_resample_whole_patients():
    from octfw.evaluation.metrics import overlap_metrics

    scores = overlap_metrics([3, 0, 5], [4, 2, 5], [4, 0, 7], ["a", "a", "b"], prefix="voxel_")
    assert scores["voxel_dice"] == pytest.approx(2 * 8 / (11 + 11)) and scores["voxel_iou"] == pytest.approx(8 / 14)
    assert scores["voxel_dice/a"] == pytest.approx(6 / 10)
    background = overlap_metrics([0, 0], [0, 0], [5, 1], ["a", "a"])
    assert background["dice"] == 0.0 and background["iou"] == 0.0  # the all-background predictor
    # Two volumes of one patient always come together: with one patient there is no spread.
    one_patient = overlap_metrics([3, 1], [4, 2], [4, 3], ["a", "a"], groups=["p", "p"], bootstrap=100)
    assert one_patient["dice_ci_low"] == one_patient["dice_ci_high"] == one_patient["dice"]


# --- the commands ---------------------------------------------------------------------------------


def test_shots_draw_a_dense_label_efficiency_curve(tmp_path, capsys):
    encoder = _encoder()
    recipe = {"transform": {"name": "oct-standard", "image_size": list(IMAGE)}, "model": {"name": "vjepa3d"}}
    export = tmp_path / "encoder.pt"
    write_export("octfw", export, encoder, encoder_info(encoder.architecture(), recipe, "hand-made", 0, {}))
    eval_recipe = tmp_path / "eval.toml"
    eval_recipe.write_text(textwrap.dedent("""
        [run]
        device = "cpu"

        [[evaluator]]
        name = "dense-probe"
        dataset = { name = "phantom-oct", family = "tuning", n_volumes = 36, seed = 1 }
        epochs = 10
        fine_tune_epochs = 0
        bootstrap = 50
    """), encoding="utf-8")
    png = tmp_path / "shots.png"
    assert main(["eval", str(export), "--recipe", str(eval_recipe), "--shots", "2,all", "--draws", "1",
                 "--png", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "dense-probe voxel_dice:" in printed and "dense-probe token_dice:" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with png.with_suffix(".csv").open(encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["metric"] == "voxel_dice"]
    assert {(r["encoder"], r["shots"]) for r in rows} == {(e, s) for e in ("pretrained", "random_init")
                                                        for s in ("2", "all")}
    assert all(0.0 <= float(r["mean"]) <= 1.0 for r in rows)
    # The difference from random init, paired over the test patients (per-volume counts kept).
    for row in (r for r in rows if r["encoder"] == "pretrained"):
        assert float(row["difference_ci_low"]) <= float(row["difference"]) <= float(row["difference_ci_high"])


def test_the_evaluator_runs_from_a_training_recipes_evaluator_table(tmp_path):
    from conftest import TINY_RECIPE

    recipe = tmp_path / "recipe.toml"
    recipe.write_text(TINY_RECIPE.replace("max_steps = 4", "max_steps = 1") + textwrap.dedent("""
        [[evaluator]]
        name = "dense-probe"
        dataset = { name = "phantom-oct", family = "held-out", n_volumes = 36, seed = 2 }
        epochs = 3
        fine_tune_epochs = 1
        bootstrap = 0
    """), encoding="utf-8")
    assert main(["run", str(recipe), "--set", f"run.output_dir={tmp_path / 'runs'}"]) == 0
    (metrics,) = (tmp_path / "runs").rglob("metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    dice = [row[key] for row in rows for key in row if key.endswith("voxel_dice")]
    assert dice and all(0.0 <= d <= 1.0 for d in dice)
