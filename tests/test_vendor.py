"""The ``oct-vendor`` dataset and OPT DICOM written by oct-converter.

There are no real device files here. Every vendor file is built byte by
byte (``tests/vendor_files.py``) with oct-converter 0.7.0's own binary
structures, in the layout its readers parse: Topcon ``.fds`` and ``.fda``
(uncompressed and lossless-JPEG-2000 B-scans), Heidelberg ``.e2e`` and
Bioptigen ``.OCT``; Zeiss ``.img`` is raw bytes. For each, the dataset must
return the B-scans as ``[D, H, W]`` with the values the reader decodes,
the spacing the format records, the vendor's domain and no patient
identifier; a truncated copy and garbage must be quarantined with a
reason. oct-converter's Topcon readers need octfw's numpy >= 2.3 shim
(``octfw.plugins.datasets.vendor.oct_converter_compat``), tested here too. OPT DICOM written
by oct-converter's DICOM writer (from a ``.img`` and from explicit metadata
carrying patient identifiers) is read by octfw's DICOM reader with its
spacing.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import numpy as np
import pytest

from octfw.plugins.datasets.vendor import OctVendorConfig, build
from octfw.display.errors import CorruptFile, UserError
from octfw.registry import load_registry
from octfw.types import BuildContext

from vendor_files import Patient, boct_bytes, e2e_bytes, e2e_intensity, fda_bytes, fds_bytes

PATIENT_ID, FIRST, LAST = "PID-77120-VN", "Marlowe", "Quintarra"
PATIENT = Patient(PATIENT_ID, FIRST, LAST, datetime.date(1951, 3, 4))
SECRETS = [PATIENT_ID, FIRST, LAST, "1951"]


def _ctx(tmp_path):
    return BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path / "cache", run_dir=None, seed=0)


def test_missing_oct_converter_is_a_user_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "oct_converter", None)  # import now fails
    monkeypatch.setitem(sys.modules, "oct_converter.readers", None)
    (tmp_path / "a.img").write_bytes(b"\0" * 64)
    with pytest.raises(UserError, match=r"octfw\[vendor\]"):
        build(OctVendorConfig(path=str(tmp_path)), _ctx(tmp_path))


def test_component_is_registered_with_documented_options():
    component = load_registry(entry_points=[]).get("dataset", "oct-vendor")
    assert component.config is OctVendorConfig
    with pytest.raises(ValueError, match="unknown vendor extensions"):
        OctVendorConfig(path="x", extensions=(".dcm",))


# --- the numpy >= 2.3 shim ------------------------------------------------------


def test_numpy_proxy_reads_binary_fromstring_as_a_writable_frombuffer_copy():
    from octfw.plugins.datasets.vendor.oct_converter_compat import NUMPY_PROXY

    raw = np.arange(6, dtype="<u2").tobytes()
    got = NUMPY_PROXY.fromstring(raw, dtype=np.uint16)
    np.testing.assert_array_equal(got, np.frombuffer(raw, dtype=np.uint16))
    assert got.dtype == np.uint16 and got.flags.writeable and got.flags.owndata
    got[0] = 9  # the caller may write, as it could into fromstring's result
    assert NUMPY_PROXY.fromstring(raw, dtype=np.uint16, count=2).tolist() == [0, 1]
    assert NUMPY_PROXY.fromstring(b"\x05", dtype=np.uint8)[0] == 5
    # Text mode and everything else are numpy's own.
    assert NUMPY_PROXY.fromstring("1 2", dtype=float, sep=" ").tolist() == [1.0, 2.0]
    assert NUMPY_PROXY.uint16 is np.uint16 and NUMPY_PROXY.frombuffer is np.frombuffer


def test_oct_converter_patch_is_idempotent_and_leaves_numpy_alone(oct_converter):
    from octfw.plugins.datasets.vendor import oct_converter_compat as compat
    from octfw.plugins.datasets.vendor.reader import require_oct_converter

    fromstring = np.fromstring
    require_oct_converter()  # applies the patch
    first, second = compat.patch_oct_converter(), compat.patch_oct_converter()
    assert first == second
    assert np.fromstring is fromstring and sys.modules["numpy"] is np
    import oct_converter.readers.fda as fda
    import oct_converter.readers.fds as fds

    if compat.binary_fromstring_works():  # numpy < 2.3: nothing to do
        assert first == [] and fds.np is np and fda.np is np
    else:
        assert sorted(first) == sorted(compat.MODULES)
        assert fds.np is compat.NUMPY_PROXY and fda.np is compat.NUMPY_PROXY


# --- with oct-converter installed ---------------------------------------------


def _volume(seed=0, shape=(4, 24, 16), high=3000, dtype=np.uint16):
    return np.random.default_rng(seed).integers(10, high, size=shape, dtype=dtype)


def _e2e_values(seed=0, shape=(5, 20, 12)):
    """Intensities an .e2e can hold exactly: (1 + k/1024) * 2**e, e in [-12, -2]."""
    rng = np.random.default_rng(seed)
    return (1 + rng.integers(0, 1024, size=shape) / 1024) * 2.0 ** rng.integers(-12, -1, size=shape)


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def _holds_identifiers(data: bytes) -> bool:
    """The built file carries the patient's name and ID (so the test means something)."""
    return all(s.encode() in data for s in (PATIENT_ID, FIRST, LAST))


@pytest.fixture
def oct_converter():
    return pytest.importorskip("oct_converter")


def test_topcon_fds_reads_with_spacing_and_no_identifiers(tmp_path, oct_converter):
    volume = _volume(1)
    data = fds_bytes(volume, x_mm=6.0, y_mm=6.0, z_um=2.6, patient=PATIENT)
    assert _holds_identifiers(data)
    (tmp_path / "scan.fds").write_bytes(data)
    dataset = build(OctVendorConfig(path=str(tmp_path)), _ctx(tmp_path))
    sample = dataset.load(0)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))
    # (dz, dy, dx): 6 mm over 4 B-scans, 2.6 um axial, 6 mm over 16 A-scans.
    assert sample.provenance.spacing == pytest.approx((1.5, 0.0026, 0.375))
    assert (sample.provenance.domain, sample.provenance.source) == ("topcon", str(tmp_path / "scan.fds"))
    assert not _leaks(repr(sample.provenance))


def test_topcon_fda_uncompressed_reads_with_the_files_spacing_and_no_identifiers(tmp_path, oct_converter):
    volume = _volume(7, shape=(5, 32, 20))
    data = fda_bytes(volume, x_mm=3.0, y_mm=2.5, z_um=3.1, patient=PATIENT)
    assert _holds_identifiers(data)
    (tmp_path / "macula.fda").write_bytes(data)
    # The file's spacing wins over default_spacing on every axis it records.
    dataset = build(OctVendorConfig(path=str(tmp_path), default_spacing=(9.0, 9.0, 9.0)), _ctx(tmp_path))
    sample = dataset.load(0)
    assert sample.volume.shape == (5, 32, 20)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))
    # (dz, dy, dx): 2.5 mm over 5 B-scans, 3.1 um axial, 3 mm over 20 A-scans.
    assert sample.provenance.spacing == pytest.approx((0.5, 0.0031, 0.15))
    assert sample.provenance.domain == "topcon" and dataset.domain(0) == "topcon"
    assert not _leaks(repr(sample.provenance))


def test_topcon_fda_jpeg2000_bscans_read_exactly(tmp_path, oct_converter):
    from PIL import features

    if not features.check("jpg_2000"):
        pytest.skip("Pillow was built without OpenJPEG")
    volume = _volume(8, shape=(3, 28, 18), high=255, dtype=np.uint8)
    data = fda_bytes(volume, x_mm=6.0, y_mm=6.0, z_um=2.6, patient=PATIENT, jpeg2000=True)
    assert _holds_identifiers(data)
    (tmp_path / "jpeg.fda").write_bytes(data)
    sample = build(OctVendorConfig(path=str(tmp_path)), _ctx(tmp_path)).load(0)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))  # lossless
    assert sample.provenance.spacing == pytest.approx((2.0, 0.0026, 6.0 / 18))
    assert sample.provenance.domain == "topcon" and not _leaks(repr(sample.provenance))


def test_heidelberg_e2e_reads_log_intensities_axial_spacing_and_no_identifiers(tmp_path, oct_converter):
    from octfw.dicom.header import SpacingDefaulted

    values = _e2e_values(4)
    data = e2e_bytes(values, axial_mm=0.0039, patient=PATIENT)
    assert _holds_identifiers(data)
    (tmp_path / "spectralis.e2e").write_bytes(data)
    with pytest.warns(SpacingDefaulted) as caught:
        sample = build(OctVendorConfig(path=str(tmp_path)), _ctx(tmp_path)).load(0)
    assert sample.volume.shape == (5, 20, 12)
    # oct-converter does not return the stored linear intensities but its
    # display transform of them, (log(v + 2.44e-4) + 8.3) / 8.285 clipped to
    # [0, 1]; that is what octfw trains on, so that is what is checked.
    np.testing.assert_allclose(sample.volume, e2e_intensity(values).astype(np.float32), rtol=1e-6)
    # Only the axial scale is read from the file; the other axes are 1.0 with
    # a warning naming them (oct-converter's 0.01 / 0.05 are placeholders).
    assert sample.provenance.spacing == pytest.approx((1.0, 0.0039, 1.0))
    assert caught[0].message.missing == ("slice spacing", "lateral pixel spacing")
    assert sample.provenance.domain == "heidelberg" and not _leaks(repr(sample.provenance))

    with_defaults = build(OctVendorConfig(path=str(tmp_path), default_spacing=(0.12, 9.0, 0.011)),
                          _ctx(tmp_path)).load(0)
    assert with_defaults.provenance.spacing == pytest.approx((0.12, 0.0039, 0.011))


def test_bioptigen_oct_reads_bscans_axial_by_lateral(tmp_path, oct_converter):
    from octfw.dicom.header import SpacingDefaulted

    volume = _volume(9, shape=(4, 30, 14))
    (tmp_path / "mouse_OD.OCT").write_bytes(
        boct_bytes(volume, scan_length_mm=1.4, scan_depth_mm=1.5, el_scan_length_mm=0.4))
    dataset = build(OctVendorConfig(path=str(tmp_path), default_spacing=(0.1, 0.05, 0.1)), _ctx(tmp_path))
    sample = dataset.load(0)
    # oct-converter returns [A-scans, samples] per B-scan; octfw transposes.
    assert sample.volume.shape == (4, 30, 14)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))
    # oct-converter derives no spacing from the header's scan lengths.
    assert sample.provenance.spacing == pytest.approx((0.1, 0.05, 0.1))
    assert sample.provenance.domain == "bioptigen"
    with pytest.warns(SpacingDefaulted) as caught:
        build(OctVendorConfig(path=str(tmp_path)), _ctx(tmp_path)).load(0)
    assert caught[0].message.missing == ("slice spacing", "pixel spacing")


def test_zeiss_img_reads_with_the_configured_shape_and_spacing(tmp_path, oct_converter):
    rows, cols, slices = 20, 12, 3
    raw = np.random.default_rng(2).integers(1, 255, size=(rows, cols, slices), dtype=np.uint8)
    (tmp_path / "zeiss").mkdir()
    (tmp_path / "zeiss" / "cube.img").write_bytes(raw.tobytes(order="F"))
    dataset = build(OctVendorConfig(path=str(tmp_path), img_shape=(rows, cols),
                                    default_spacing=(0.047, 0.002, 0.012)), _ctx(tmp_path))
    sample = dataset.load(0)
    np.testing.assert_array_equal(sample.volume, np.transpose(raw, (2, 0, 1)).astype(np.float32))
    assert sample.provenance.spacing == pytest.approx((0.047, 0.002, 0.012))
    assert dataset.domain(0) == "zeiss"


def test_unreadable_vendor_files_are_corrupt_with_a_reason_and_no_identifiers(tmp_path, oct_converter):
    files = {
        "fds": fds_bytes(_volume(3), 6.0, 6.0, 2.6, patient=PATIENT),
        "fda": fda_bytes(_volume(4), 6.0, 6.0, 2.6, patient=PATIENT),
        "e2e": e2e_bytes(_e2e_values(5), 0.0039, patient=PATIENT),
        "OCT": boct_bytes(_volume(6), 6.0, 2.0, 6.0),
    }
    for suffix, good in files.items():
        (tmp_path / f"cut.{suffix}").write_bytes(good[: len(good) // 2])
    # An .e2e cut exactly before its last chunk (the last B-scan's pixels):
    # oct-converter alone returns one B-scan fewer, without any error.
    last_chunk = 60 + 20 + 20 * 12 * 2  # chunk header, image header, uint16 pixels
    (tmp_path / "cut-at-chunk.e2e").write_bytes(files["e2e"][:-last_chunk])
    (tmp_path / "noise.e2e").write_bytes(b"CMDb" + bytes(range(256)) * 4)
    (tmp_path / "noise.fda").write_bytes(b"not topcon")
    (tmp_path / "noise.OCT").write_bytes(b"\x01\x02")
    (tmp_path / "flat.fds").write_bytes(fds_bytes(np.full((3, 8, 8), 9, np.uint16), 6.0, 6.0, 2.6))
    dataset = build(OctVendorConfig(path=str(tmp_path)), _ctx(tmp_path))
    assert dataset.domain_counts() == {"bioptigen": 2, "heidelberg": 3, "topcon": 4}
    reasons = {}
    for index in range(len(dataset)):
        with pytest.raises(CorruptFile) as info:
            dataset.load(index)
        assert info.value.url == dataset.source(index)
        reasons[Path(info.value.url).name] = info.value.reason
    assert "constant volume" in reasons["flat.fds"]
    assert "truncated" in reasons["cut.e2e"] and "truncated" in reasons["cut-at-chunk.e2e"]
    assert all(reasons.values()) and not _leaks(" ".join(reasons.values()))


def test_opt_dicom_converted_by_oct_converter_from_a_zeiss_img_is_read_with_its_spacing(
        tmp_path, oct_converter):
    from oct_converter.dicom import create_dicom_from_oct

    from octfw.dicom.decoding import read_oct_volume

    rows, cols, slices = 24, 16, 5
    raw = np.random.default_rng(5).integers(1, 255, size=(rows, cols, slices), dtype=np.uint8)
    (tmp_path / "cube.img").write_bytes(raw.tobytes(order="F"))
    written = create_dicom_from_oct(str(tmp_path / "cube.img"), str(tmp_path / "dicom"),
                                    rows=rows, cols=cols)
    sample = read_oct_volume(Path(written[0]) if isinstance(written, list) else Path(written))
    assert sample.volume.shape == (slices, rows, cols)
    # oct-converter's fixed Zeiss geometry: PixelSpacing [0.002, 0.002], SliceThickness 0.004.
    assert sample.provenance.spacing == pytest.approx((0.004, 0.002, 0.002))
    assert sample.provenance.domain == "zeiss"
    # It rescales intensities (to 0-100); the B-scans keep their order and structure.
    expected = np.transpose(raw, (2, 0, 1)).astype(np.float64)
    assert np.corrcoef(sample.volume.ravel(), expected.ravel())[0, 1] > 0.99


def test_opt_dicom_from_oct_converters_writer_keeps_spacing_and_drops_identifiers(tmp_path, oct_converter):
    import datetime

    from oct_converter.dicom.dicom import write_opt_dicom
    from oct_converter.dicom.metadata import (DicomMetadata, ImageGeometry, ManufacturerMeta,
                                              OCTImageParams, PatientMeta, SeriesMeta)

    from octfw.dicom.dataset import DicomDataset
    from octfw.dicom.decoding import read_oct_volume
    from octfw.dicom.header import read_header

    meta = DicomMetadata(
        patient_info=PatientMeta(first_name=FIRST, last_name=LAST, patient_id=PATIENT_ID,
                                 patient_sex="F", patient_dob=datetime.date(1951, 3, 4)),
        series_info=SeriesMeta(study_id="1", series_id=1, laterality="R", protocol="3D",
                               description="", acquisition_date=None),
        manufacturer_info=ManufacturerMeta(manufacturer="Heidelberg Engineering",
                                           manufacturer_model="Spectralis", device_serial="",
                                           software_version=""),
        image_geometry=ImageGeometry(pixel_spacing=[0.0039, 0.0113], slice_thickness=0.12,
                                     image_orientation=[1, 0, 0, 0, 1, 0]),
        oct_image_params=OCTImageParams(),
    )
    volume = _volume(6, shape=(6, 28, 18))
    path = tmp_path / "scans" / "spectralis.dcm"
    path.parent.mkdir()
    write_opt_dicom(meta, [frame for frame in volume], path)
    assert _leaks(path.read_bytes().decode("latin-1")), "the writer put the identifiers in the file"

    sample = read_oct_volume(path)
    assert sample.volume.shape == (6, 28, 18)
    assert sample.provenance.spacing == pytest.approx((0.12, 0.0039, 0.0113))
    assert sample.provenance.domain == "heidelberg"
    assert np.corrcoef(sample.volume.ravel(), volume.astype(np.float64).ravel())[0, 1] > 0.99
    assert not _leaks(repr(sample.provenance)) and not _leaks(repr(read_header(path)))
    assert DicomDataset.from_location(tmp_path / "scans").domain_counts() == {"heidelberg": 1}
