"""Reading and writing OCT DICOM: round trips, real pydicom test files, and
every way a file can be unusable raising CorruptFile with its reason."""

from __future__ import annotations

import uuid

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless, JPEGLSLossless, RLELossless

from octfw.dicom.decoding import read_oct_volume
from octfw.dicom.files import write_bytes
from octfw.dicom.header import SpacingDefaulted, normalise_manufacturer, read_header
from octfw.dicom.writing import OCT_SOP_CLASS_UID, write_oct_dicom
from octfw.display.errors import CorruptFile

PATIENT = {"PatientName": "Doe^Janet", "PatientID": "MRN-99817", "PatientBirthDate": "19610412"}
SPACING = (0.12, 0.0039, 0.0113)


def _volume(shape=(5, 32, 40), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=shape, dtype=np.uint16)


def _write(tmp_path, name="vol.dcm", volume=None, **kwargs) -> str:
    volume = _volume() if volume is None else volume
    kwargs.setdefault("patient", PATIENT)
    return write_oct_dicom(tmp_path / name, volume, SPACING, "Heidelberg Engineering", "Spectralis", **kwargs)


def _corrupt_reason(path) -> str:
    with pytest.raises(CorruptFile) as info:
        read_oct_volume(path)
    assert info.value.url == str(path)
    return info.value.reason


# --- round trips ----------------------------------------------------------


@pytest.mark.parametrize(
    "transfer_syntax", [ExplicitVRLittleEndian, RLELossless, JPEG2000Lossless, JPEGLSLossless],
    ids=["explicit-le", "rle", "jpeg2000-lossless", "jpegls-lossless"],
)
def test_round_trip_keeps_voxels_spacing_and_domain(tmp_path, transfer_syntax):
    volume = _volume()
    path = _write(tmp_path, volume=volume, transfer_syntax=transfer_syntax)

    sample = read_oct_volume(path)

    assert sample.volume.dtype == np.float32
    assert sample.volume.shape == (5, 32, 40)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))
    assert sample.provenance.spacing == pytest.approx(SPACING)
    assert sample.provenance.domain == "heidelberg"
    assert sample.provenance.original_shape == (5, 32, 40)
    assert sample.provenance.source == path
    assert pydicom.dcmread(path).file_meta.TransferSyntaxUID == transfer_syntax


def test_written_file_is_multiframe_ophthalmic_tomography(tmp_path):
    path = _write(tmp_path, patient=None)
    ds = pydicom.dcmread(path)

    assert ds.SOPClassUID == OCT_SOP_CLASS_UID
    assert ds.file_meta.MediaStorageSOPClassUID == OCT_SOP_CLASS_UID
    assert ds.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
    assert (ds.NumberOfFrames, ds.Rows, ds.Columns) == (5, 32, 40)
    assert (ds.BitsAllocated, ds.PixelRepresentation, ds.SamplesPerPixel) == (16, 0, 1)
    assert (ds.Manufacturer, ds.ManufacturerModelName) == ("Heidelberg Engineering", "Spectralis")
    measures = ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    assert [float(v) for v in measures.PixelSpacing] == pytest.approx([SPACING[1], SPACING[2]])
    assert float(measures.SliceThickness) == pytest.approx(SPACING[0])
    assert float(ds.SpacingBetweenSlices) == pytest.approx(SPACING[0])
    assert len(ds.PerFrameFunctionalGroupsSequence) == 5
    # Patient identifiers appear only when given.
    assert str(ds.PatientName) == "" and ds.PatientID == "" and ds.PatientBirthDate == ""


def test_uid_entropy_makes_files_byte_identical(tmp_path):
    first = _write(tmp_path, "a.dcm", uid_entropy=["cohort", "7"])
    second = _write(tmp_path, "b.dcm", uid_entropy=["cohort", "7"])
    other = _write(tmp_path, "c.dcm", uid_entropy=["cohort", "8"])
    assert open(first, "rb").read() == open(second, "rb").read()
    assert pydicom.dcmread(first).SOPInstanceUID != pydicom.dcmread(other).SOPInstanceUID


def test_a_single_frame_oct_file_on_its_own_is_corrupt(tmp_path):
    path = _write(tmp_path, volume=_volume((1, 16, 20)))
    assert _corrupt_reason(path) == "single-frame 2D image; a 3D OCT volume needs several B-scans"


def test_reads_remote_urls_through_fsspec(tmp_path):
    url = f"memory://octfw-test-{uuid.uuid4().hex}/scan.dcm"
    volume = _volume()
    write_oct_dicom(url, volume, SPACING, "TOPCON Corporation", "3D OCT-2000")
    sample = read_oct_volume(url)
    np.testing.assert_array_equal(sample.volume, volume)
    assert sample.provenance.domain == "topcon"
    assert read_header(url)["number_of_frames"] == 5


def test_domain_and_label_overrides_reach_provenance(tmp_path):
    sample = read_oct_volume(_write(tmp_path), domain="site-a", label=1)
    assert (sample.provenance.domain, sample.provenance.label) == ("site-a", 1)


@pytest.mark.parametrize(
    "manufacturer, domain",
    [
        ("Heidelberg Engineering", "heidelberg"),
        ("HEIDELBERG", "heidelberg"),
        ("TOPCON Corporation", "topcon"),
        ("Carl Zeiss Meditec", "zeiss"),
        ("GE MEDICAL SYSTEMS", "ge-medical-systems"),
        ("", "unknown"),
        (None, "unknown"),
    ],
)
def test_manufacturer_names_normalise_to_domains(manufacturer, domain):
    assert normalise_manufacturer(manufacturer) == domain


# --- pydicom's own multi-frame test files --------------------------------


@pytest.mark.parametrize("name", ["rtdose.dcm", "rtdose_expb.dcm", "rtdose_rle.dcm"])
def test_reads_pydicom_rtdose_files_in_several_transfer_syntaxes(name):
    reference = pydicom.dcmread(get_testdata_file("rtdose.dcm")).pixel_array
    with pytest.warns(SpacingDefaulted, match="slice spacing") as record:
        sample = read_oct_volume(get_testdata_file(name))
    assert record[0].message.url == get_testdata_file(name)
    assert record[0].message.missing == ("slice spacing",)
    assert sample.volume.shape == (15, 10, 10)
    np.testing.assert_array_equal(sample.volume, reference.astype(np.float32))
    # PixelSpacing is in the header; the distance between frames is not.
    assert sample.provenance.spacing == (1.0, 10.0, 10.0)


EMRI_FILES = [
    "emri_small.dcm",
    "emri_small_RLE.dcm",
    "emri_small_jpeg_2k_lossless.dcm",
    "emri_small_jpeg_ls_lossless.dcm",
]


@pytest.mark.parametrize("name", EMRI_FILES)
def test_reads_pydicom_emri_files_in_several_transfer_syntaxes(name):
    # These files ship in the pydicom-data package (the dev extra installs it).
    path = get_testdata_file(name)
    reference_path = get_testdata_file("emri_small.dcm")
    assert path is not None and reference_path is not None, "install pydicom-data (octfw[dev])"
    reference = pydicom.dcmread(reference_path).pixel_array
    sample = read_oct_volume(path)
    assert sample.volume.ndim == 3 and sample.volume.shape[0] > 1
    np.testing.assert_array_equal(sample.volume, reference.astype(np.float32))


@pytest.mark.parametrize("name", ["rtdose.dcm", "rtdose_rle.dcm"])
def test_truncated_copy_of_a_pydicom_file_is_corrupt(tmp_path, name):
    data = open(get_testdata_file(name), "rb").read()
    path = tmp_path / name
    path.write_bytes(data[: int(len(data) * 0.8)])
    assert "truncated" in _corrupt_reason(path)


# --- corrupt files --------------------------------------------------------


def test_not_dicom_is_corrupt(tmp_path):
    path = tmp_path / "notes.dcm"
    path.write_bytes(b"patient notes, not an image\n" * 20)
    assert _corrupt_reason(path) == "not a DICOM file (no DICM preamble)"


def test_garbage_after_the_preamble_is_corrupt(tmp_path):
    path = tmp_path / "garbage.dcm"
    path.write_bytes(b"\0" * 128 + b"DICM" + np.random.default_rng(1).bytes(300))
    assert _corrupt_reason(path)


def test_file_cut_inside_the_header_is_corrupt(tmp_path):
    data = open(_write(tmp_path), "rb").read()
    path = tmp_path / "cut.dcm"
    path.write_bytes(data[:300])
    assert _corrupt_reason(path)


@pytest.mark.parametrize("transfer_syntax", [ExplicitVRLittleEndian, JPEG2000Lossless, RLELossless])
def test_truncated_pixel_data_is_corrupt(tmp_path, transfer_syntax):
    data = open(_write(tmp_path, transfer_syntax=transfer_syntax), "rb").read()
    path = tmp_path / "short.dcm"
    path.write_bytes(data[: len(data) - 1234])
    assert "truncated" in _corrupt_reason(path)


def test_missing_pixel_data_is_corrupt(tmp_path):
    ds = pydicom.dcmread(_write(tmp_path))
    del ds.PixelData
    ds.save_as(tmp_path / "nopix.dcm")
    assert _corrupt_reason(tmp_path / "nopix.dcm") == "no PixelData element"


@pytest.mark.parametrize("transfer_syntax", [ExplicitVRLittleEndian, JPEG2000Lossless])
@pytest.mark.parametrize("frames", [3, 8])
def test_frame_count_disagreeing_with_pixel_data_is_corrupt(tmp_path, transfer_syntax, frames):
    ds = pydicom.dcmread(_write(tmp_path, transfer_syntax=transfer_syntax))
    ds.NumberOfFrames = frames
    ds.save_as(tmp_path / "frames.dcm")
    reason = _corrupt_reason(tmp_path / "frames.dcm")
    assert reason.startswith(f"frame count mismatch: NumberOfFrames is {frames}")


def test_constant_volume_is_corrupt(tmp_path):
    path = _write(tmp_path, volume=np.full((4, 16, 16), 812, dtype=np.uint16))
    assert _corrupt_reason(path) == "constant volume (every voxel is 812)"


def test_non_finite_voxels_are_corrupt(tmp_path):
    ds = pydicom.dcmread(_write(tmp_path))
    values = ds.pixel_array.astype(np.float32)
    values[2, 3, 4] = np.nan
    values[0, 0, 0] = np.inf
    del ds.PixelData, ds.BitsStored, ds.HighBit, ds.PixelRepresentation
    ds.BitsAllocated = 32
    ds.FloatPixelData = values.tobytes()
    ds.save_as(tmp_path / "nan.dcm")
    assert _corrupt_reason(tmp_path / "nan.dcm") == "2 non-finite voxels"


def test_a_width_of_one_is_corrupt(tmp_path):
    path = _write(tmp_path, volume=_volume((4, 16, 1)))
    assert _corrupt_reason(path).startswith("wrong dimensions")


@pytest.mark.parametrize("name", ["CT_small.dcm", "MR_small_jp2klossless.dcm"])
def test_a_single_2d_image_that_is_not_oct_is_corrupt(name):
    with pytest.raises(CorruptFile, match="single-frame 2D image"):
        read_oct_volume(get_testdata_file(name))


def test_a_colour_multiframe_file_is_corrupt():
    with pytest.raises(CorruptFile, match="samples per pixel"):
        read_oct_volume(get_testdata_file("SC_rgb_rle_2frame.dcm"))


def test_a_missing_file_is_corrupt(tmp_path):
    assert _corrupt_reason(tmp_path / "gone.dcm") == "file not found"


def test_pydicom_errors_never_escape_as_anything_else():
    # badVR.dcm holds a value pydicom cannot convert.
    with pytest.raises(CorruptFile):
        read_oct_volume(get_testdata_file("badVR.dcm"))


def test_header_is_read_without_decoding_pixels(tmp_path):
    data = open(_write(tmp_path), "rb").read()
    path = tmp_path / "short.dcm"
    path.write_bytes(data[:-1000])
    header = read_header(path)
    assert header["domain"] == "heidelberg"
    assert header["manufacturer"] == "Heidelberg Engineering"
    assert (header["number_of_frames"], header["rows"], header["columns"]) == (5, 32, 40)
    with pytest.raises(CorruptFile):
        read_oct_volume(path)


def test_header_of_a_non_dicom_file_is_corrupt(tmp_path):
    write_bytes(str(tmp_path / "x.dcm"), b"nope")
    with pytest.raises(CorruptFile, match="not a DICOM file"):
        read_header(tmp_path / "x.dcm")


# --- privacy --------------------------------------------------------------


def _leaks(text: str) -> list[str]:
    needles = ["Doe", "Janet", "MRN-99817", "19610412"]
    return [n for n in needles if n in text]


def test_patient_identifiers_never_reach_samples_headers_or_errors(tmp_path):
    good = _write(tmp_path, "good.dcm")
    assert str(pydicom.dcmread(good).PatientName) == "Doe^Janet"  # really in the file
    sample = read_oct_volume(good)
    assert _leaks(repr(sample.provenance)) == []
    assert _leaks(repr(read_header(good))) == []

    data = open(good, "rb").read()
    broken = {
        "truncated.dcm": data[:-700],
        "header-cut.dcm": data[:200],
        "no-pixels.dcm": data[: data.rindex(b"\xe0\x7f\x10\x00OW")],
    }
    for name, content in broken.items():
        (tmp_path / name).write_bytes(content)
    frames = pydicom.dcmread(good)
    frames.NumberOfFrames = 9
    frames.save_as(tmp_path / "frames.dcm")
    _write(tmp_path, "constant.dcm", volume=np.zeros((3, 8, 8), dtype=np.uint16))

    for name in [*broken, "frames.dcm", "constant.dcm"]:
        with pytest.raises(CorruptFile) as info:
            read_oct_volume(tmp_path / name)
        assert _leaks(str(info.value)) == [], name
        assert _leaks(info.value.reason) == [], name


def test_patient_keys_outside_the_patient_module_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown patient keys"):
        _write(tmp_path, patient={"OtherPatientIDs": "x"})

