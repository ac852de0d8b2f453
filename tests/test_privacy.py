"""No patient identifier from a DICOM header leaves the reader.

A cohort whose every file carries a distinctive PatientName, PatientID and
PatientBirthDate (including a corrupt file that is quarantined and a series
of single-frame files) is checked and trained on; then every byte the run
wrote (run directory, checkpoints both raw and unpickled, metrics,
quarantine report, summary, prepared-volume cache) and everything printed
is searched for those identifiers.
"""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import numpy as np
import pydicom
import torch

from octfw.cli.main import main
from octfw.dicom.writing import encode_oct_dicom, write_oct_dicom

PATIENT = {
    "PatientName": "Qorvalis^Zentrick",
    "PatientID": "PID-48213-XQ",
    "PatientBirthDate": "19370214",
    "PatientSex": "F",
}
# Each identifier, and the parts a name splits into.
SECRETS = ["Qorvalis", "Zentrick", "PID-48213-XQ", "48213", "19370214", "1937-02-14"]
VENDORS = [("Heidelberg Engineering", "heidelberg"), ("TOPCON Corporation", "topcon")]

RECIPE = """
[run]
seed = 0
output_dir = "runs"
max_steps = 4
device = "cpu"
cache_dir = "cache"

[engine]
per_device_batch = 2
base_lr = 1e-3
log_every_steps = 1
checkpoint_every_steps = 2

[dataset]
name = "dicom"
path = "cohort"

[transform]
name = "oct-standard"
image_size = [4, 16, 16]

[model]
name = "vjepa3d"
preset = "tiny"
patch_size = [2, 8, 8]

[scheduler]
name = "constant"

[[logger]]
name = "console"

[[logger]]
name = "jsonl"
"""


def _volume(seed: int, shape=(4, 20, 16)) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 4000, size=shape, dtype=np.uint16)


def write_identified_cohort(folder: Path) -> None:
    for index in range(6):
        manufacturer, domain = VENDORS[index % 2]
        write_oct_dicom(folder / domain / f"{index:03d}.dcm", _volume(index), (0.2, 0.01, 0.02),
                        manufacturer, "M", patient=PATIENT)
    # A truncated file: its header (with the identifiers) reads, its pixels do not.
    data = encode_oct_dicom(_volume(9), (0.2, 0.01, 0.02), "Heidelberg Engineering", "M", patient=PATIENT)
    (folder / "heidelberg" / "broken.dcm").write_bytes(data[: len(data) - 300])
    # A file that is DICOM only in name, with an identifier in its garbage.
    (folder / "topcon" / "garbage.dcm").write_bytes(b"DICM" + PATIENT["PatientName"].encode() * 20)
    # A series of single-frame files carrying the identifiers too.
    series = folder / "topcon" / "series"
    series.mkdir(parents=True)
    for frame in range(3):
        ds = pydicom.dcmread(io.BytesIO(encode_oct_dicom(
            _volume(20 + frame, (1, 20, 16)), (0.2, 0.01, 0.02), "TOPCON Corporation", "M",
            patient=PATIENT)))
        ds.SeriesInstanceUID = "1.2.826.0.1.3680043.8.498.1"
        ds.InstanceNumber = frame + 1
        ds.save_as(series / f"f{frame}.dcm", enforce_file_format=True)


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def leaks(data: bytes) -> list[str]:
    return [secret for secret in SECRETS if secret.encode() in data]


def test_no_patient_identifier_reaches_outputs_logs_checkpoints_or_the_cache(tmp_path, capsys):
    write_identified_cohort(tmp_path / "cohort")
    (tmp_path / "recipe.toml").write_text(textwrap.dedent(RECIPE), encoding="utf-8")

    assert main(["check", str(tmp_path / "recipe.toml")]) == 0
    assert main(["run", str(tmp_path / "recipe.toml")]) == 0
    printed = capsys.readouterr()

    run_dir = next((tmp_path / "runs" / "recipe").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == 4
    # The corrupt files were met, listed by URL and reason, and nothing else.
    quarantined = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert {Path(q["url"]).name for q in quarantined} == {"broken.dcm", "garbage.dcm"}
    checkpoints = sorted((run_dir / "checkpoints").glob("*.pt"))
    cache_files = files_under(tmp_path / "cache" / "prepared")
    assert checkpoints and cache_files

    found = {}
    for path in files_under(run_dir) + files_under(tmp_path / "cache"):
        hits = leaks(path.read_bytes())
        if hits:
            found[str(path)] = hits
    for checkpoint in checkpoints:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        hits = leaks(repr(state).encode())
        if hits:
            found[f"{checkpoint} (unpickled)"] = hits
    for stream, text in (("stdout", printed.out), ("stderr", printed.err)):
        hits = leaks(text.encode())
        if hits:
            found[stream] = hits
    assert not found, f"patient identifiers leaked: {found}"
    # The test would see a leak: the identifiers are really in the inputs.
    assert leaks((tmp_path / "cohort" / "heidelberg" / "000.dcm").read_bytes())
    assert leaks((tmp_path / "cohort" / "heidelberg" / "broken.dcm").read_bytes())


def test_a_vendor_file_run_writes_no_patient_identifier(tmp_path, capsys):
    """The same search after a run on raw Topcon and Heidelberg files that
    carry the identifiers in their patient chunks (one of them truncated)."""
    import datetime

    import pytest

    pytest.importorskip("oct_converter")
    from vendor_files import Patient, e2e_bytes, fda_bytes, fds_bytes

    patient = Patient(PATIENT["PatientID"], "Zentrick", "Qorvalis", datetime.date(1937, 2, 14))
    cohort = tmp_path / "cohort"
    cohort.mkdir()
    rng = np.random.default_rng(0)
    for index in range(3):
        volume = _volume(index)
        (cohort / f"scan{index}.fds").write_bytes(fds_bytes(volume, 6.0, 6.0, 2.6, patient=patient))
        (cohort / f"scan{index}.fda").write_bytes(fda_bytes(volume, 6.0, 6.0, 2.6, patient=patient))
        values = (1 + rng.integers(0, 1024, size=(4, 20, 16)) / 1024) * 2.0 ** rng.integers(-12, -1, (4, 20, 16))
        (cohort / f"scan{index}.e2e").write_bytes(e2e_bytes(values, axial_mm=0.0039, patient=patient))
    whole = (cohort / "scan0.e2e").read_bytes()
    (cohort / "cut.e2e").write_bytes(whole[: len(whole) // 2])
    assert all(leaks(p.read_bytes()) for p in cohort.iterdir())  # the inputs do carry them
    recipe = RECIPE.replace('name = "dicom"\npath = "cohort"',
                            'name = "oct-vendor"\npath = "cohort"\ndefault_spacing = [0.2, 0.01, 0.02]')
    (tmp_path / "recipe.toml").write_text(textwrap.dedent(recipe), encoding="utf-8")

    assert main(["run", str(tmp_path / "recipe.toml")]) == 0
    printed = capsys.readouterr()
    run_dir = next((tmp_path / "runs" / "recipe").iterdir())
    quarantined = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert [Path(q["url"]).name for q in quarantined] == ["cut.e2e"]
    found = {str(p): leaks(p.read_bytes()) for p in files_under(run_dir) + files_under(tmp_path / "cache")}
    found.update({f"{p} (unpickled)": leaks(repr(torch.load(p, map_location="cpu", weights_only=False)).encode())
                  for p in (run_dir / "checkpoints").glob("*.pt")})
    found.update(stdout=leaks(printed.out.encode()), stderr=leaks(printed.err.encode()))
    assert not {k: v for k, v in found.items() if v}, f"patient identifiers leaked: {found}"
