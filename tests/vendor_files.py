"""Vendor OCT files built byte by byte for the ``oct-vendor`` tests.

No real device files can ship with the tests, so each builder writes the
layout that oct-converter 0.7.0's reader for the format parses, using that
reader's own ``construct`` structures (``oct_converter/readers/
binary_structs/*.py``) wherever they can be built. The files are therefore
exactly what oct-converter expects; they say nothing about formats or
variants it does not know. Each builder takes a volume ``[D, H, W]`` (B-scans,
axial, lateral), the geometry the format records, and optionally a
:class:`Patient` whose fields go where the format keeps them, so tests can
check that none of them reaches octfw.
"""

from __future__ import annotations

import datetime
import io
import struct
from typing import NamedTuple

import numpy as np


class Patient(NamedTuple):
    patient_id: str
    first_name: str
    last_name: str
    birth_date: datetime.date


CAPTURED = datetime.datetime(2024, 5, 6, 7, 8, 9)


def _parsed_zeros(structure) -> dict:
    """A fixed-size struct's fields, all zero (to fill before building)."""
    return {k: v for k, v in structure.parse(b"\0" * structure.sizeof()).items() if not k.startswith("_")}


# --- Topcon .fds / .fda ------------------------------------------------------
# A 15-byte header, then chunks (name length, name, uint32 payload size,
# payload), then a zero name length. oct-converter reads pixel spacing from
# @PARAM_SCAN_04 as (x_dimension_mm / width, y_dimension_mm / slices,
# z_resolution_um / 1000), and needs @CAPTURE_INFO_02 for the capture date.


def _topcon_chunk(name: bytes, payload: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack("<I", len(payload)) + payload


def _topcon_common(binary, file_type: str, x_mm: float, y_mm: float, z_um: float,
                   patient: Patient | None) -> bytes:
    body = binary.header.build(dict(file_code="FOCT", file_type=file_type, major_ver=4, minor_ver=1))
    body += _topcon_chunk(b"@CAPTURE_INFO_02", binary.capture_info_02_header.build(dict(
        eye=0, scan_mode=2, session_id=1, label="",
        cap_date=[CAPTURED.year, CAPTURED.month, CAPTURED.day, CAPTURED.hour, CAPTURED.minute,
                  CAPTURED.second])))
    body += _topcon_chunk(b"@PARAM_SCAN_04", binary.param_scan_04_header.build(dict(
        fixation=0, mirror_pos=0, polar=0, x_dimension_mm=x_mm, y_dimension_mm=y_mm,
        z_resolution_um=z_um, comp_eff_2=0.0, comp_eff_3=0.0, base_pos=0, used_calib_data=0)))
    if patient is not None:
        record = _parsed_zeros(binary.patient_info_02_header)
        born = patient.birth_date
        record.update(patient_id=patient.patient_id, first_name=patient.first_name,
                      last_name=patient.last_name, sex=2, birth_date=[born.year, born.month, born.day])
        body += _topcon_chunk(b"@PATIENT_INFO_02", binary.patient_info_02_header.build(record))
    return body


def _uncompressed_topcon_pixels(volume: np.ndarray) -> bytes:
    # The readers reshape the uint16 run to [width, height, slices] in Fortran
    # order, so the file holds B-scan after B-scan, each A-scan by A-scan
    # (column-major [H, W]).
    return np.transpose(volume, (2, 1, 0)).astype("<u2").tobytes(order="F")


def fds_bytes(volume: np.ndarray, x_mm: float, y_mm: float, z_um: float,
              patient: Patient | None = None) -> bytes:
    """A Topcon .fds file holding uint16 ``volume`` in @IMG_SCAN_03 (uncompressed)."""
    from oct_converter.readers.binary_structs import fds_binary

    slices, height, width = volume.shape
    pixels = _uncompressed_topcon_pixels(volume)
    body = _topcon_common(fds_binary, "FDA", x_mm, y_mm, z_um, patient)
    body += _topcon_chunk(b"@IMG_SCAN_03", fds_binary.oct_header.build(dict(
        scan_mode=2, width=width, height=height, bits_per_pixel=16, number_slices=slices,
        format=0, size=len(pixels))) + pixels)
    return body + b"\0"


def fda_bytes(volume: np.ndarray, x_mm: float, y_mm: float, z_um: float,
              patient: Patient | None = None, jpeg2000: bool = False) -> bytes:
    """A Topcon .fda file.

    oct-converter reads two B-scan chunks: @IMG_JPEG (each B-scan a
    compressed image that Pillow opens) and @IMG_MOT_COMP_03 (uncompressed
    uint16). ``jpeg2000=False`` writes the latter from a uint16 ``volume``;
    ``jpeg2000=True`` writes @IMG_JPEG with each uint8 B-scan as a lossless
    JPEG 2000 codestream (needs Pillow's OpenJPEG support), so the pixels
    still come back exactly.
    """
    from oct_converter.readers.binary_structs import fda_binary

    slices, height, width = volume.shape
    body = _topcon_common(fda_binary, "FDA", x_mm, y_mm, z_um, patient)
    if jpeg2000:
        from PIL import Image

        payload = fda_binary.oct_header.build(dict(
            scan_mode=2, unknown1=0, unknown2=0, width=width, height=height,
            number_slices=slices, unknown3=0))
        for bscan in volume.astype(np.uint8):
            encoded = io.BytesIO()
            Image.fromarray(bscan, mode="L").save(encoded, format="JPEG2000", irreversible=False)
            payload += struct.pack("<i", len(encoded.getvalue())) + encoded.getvalue()
        body += _topcon_chunk(b"@IMG_JPEG", payload)
    else:
        pixels = _uncompressed_topcon_pixels(volume)
        body += _topcon_chunk(b"@IMG_MOT_COMP_03", fda_binary.oct_header_2.build(dict(
            scan_mode=2, width=width, height=height, bits_per_pixel=16, number_slices=slices,
            format=0, size=len(pixels))) + pixels)
    return body + b"\0"


# --- Heidelberg .e2e ----------------------------------------------------------
# A 36-byte header, a 52-byte main directory whose ``current`` points at the
# last directory block (each block's ``prev`` at the one before, 0 ends),
# then per block a 52-byte directory header and 44-byte entries pointing at
# chunks. A chunk is a 60-byte header then its data. oct-converter groups
# B-scans by (patient_db_id, study_id, series_id), slots them by slice_id / 2,
# takes the axial scale (``scaley``) from the first B-scan metadata chunk
# (type 10004) and stores each B-scan (type 1073741824, ind 1) as uint16
# "ufloat16" values that it decodes and then log-transforms.

E2E_IMAGE, E2E_BSCAN_META, E2E_PATIENT = 1073741824, 10004, 9
E2E_BSCAN_IMAGE_TYPE = 35652097  # eyepy's name for a B-scan image's type field


def e2e_ufloat16(values: np.ndarray) -> np.ndarray:
    """Encode values in [2**-63, 2) as the uint16 oct-converter decodes back to them.

    The format has no sign, a 6-bit exponent (bias 63, the high bits) and a
    10-bit mantissa. oct-converter (like eyepy) reads the mantissa's bits in
    reverse order (bit 0 is its most significant), so the encoder reverses
    them too. Values must be exactly representable.
    """
    values = np.asarray(values, dtype=np.float64)
    mantissa, exponent = np.frexp(values)  # values = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - 1  # values = (2 * mantissa) * 2**exponent, 2 * mantissa in [1, 2)
    fraction = (2 * mantissa - 1) * 1024
    if not np.array_equal(fraction, np.round(fraction)) or exponent.min() < -63 or exponent.max() > 0:
        raise ValueError("values are not representable in the e2e ufloat16")
    fraction = fraction.astype(np.uint16)
    reversed_bits = np.zeros_like(fraction)
    for bit in range(10):
        reversed_bits |= ((fraction >> bit) & 1) << (9 - bit)
    return ((exponent + 63).astype(np.uint16) << 10) | reversed_bits


def e2e_intensity(values: np.ndarray) -> np.ndarray:
    """What oct-converter 0.7.0 returns for decoded values <= 1: its log
    transform (E2E.vol_intensity_transform), written out here."""
    return np.clip((np.log(np.asarray(values, np.float64) + 2.44e-04) + 8.3) / 8.285, 0, 1)


def _windows_ticks(when: datetime.datetime) -> int:
    """100 ns ticks since 1601-01-01, how E2E stores acquisition times."""
    return int((when - datetime.datetime(1601, 1, 1)).total_seconds()) * 10_000_000


def e2e_bytes(values: np.ndarray, axial_mm: float, patient: Patient | None = None) -> bytes:
    """A Heidelberg .e2e file holding one volume of B-scans with these decoded values.

    ``values`` are float ``[D, H, W]`` intensities in (0, 1], exactly
    representable (see :func:`e2e_ufloat16`). The format records the axial
    pixel size per B-scan (``scaley``); oct-converter reads no lateral or
    between-B-scan spacing from it.
    """
    from oct_converter.readers.binary_structs import e2e_binary

    slices, height, width = values.shape
    raw = e2e_ufloat16(values)
    volume_ids = dict(patient_db_id=7, study_id=3, series_id=5)

    # (type, slice_id, ind, ids, data) for each chunk, in file order.
    chunks = []
    if patient is not None:
        born = patient.birth_date
        chunks.append((E2E_PATIENT, -1, 0, dict(patient_db_id=7, study_id=0, series_id=0),
                       e2e_binary.patient_id_structure.build(dict(
                           first_name=patient.first_name, surname=patient.last_name, title="",
                           # YYYYMMDD, a form oct-converter recognises
                           birthdate=int(born.strftime("%Y%m%d")), sex="F",
                           patient_id=patient.patient_id))))
    for index in range(slices):
        meta = _parsed_zeros(e2e_binary.bscan_metadata)
        meta.update(imgSizeY=height, imgSizeX=width, scaley=axial_mm, imgSizeWidth=width,
                    numImages=slices, aktImage=index, acquisitionTime=_windows_ticks(CAPTURED))
        chunks.append((E2E_BSCAN_META, 2 * index, 0, volume_ids, e2e_binary.bscan_metadata.build(meta)))
        pixels = raw[index].astype("<u2").tobytes()
        chunks.append((E2E_IMAGE, 2 * index, 1, volume_ids, e2e_binary.image_structure.build(dict(
            size=len(pixels), type=E2E_BSCAN_IMAGE_TYPE, unknown=height * width,
            height=height, width=width)) + pixels))

    header_size = e2e_binary.header_structure.sizeof()
    directory_size = e2e_binary.main_directory_structure.sizeof()
    entry_size = e2e_binary.sub_directory_structure.sizeof()
    chunk_header_size = e2e_binary.chunk_structure.sizeof()
    block = header_size + directory_size  # the one directory block
    first_chunk = block + directory_size + len(chunks) * entry_size

    def directory(num_entries: int, current: int, prev: int) -> bytes:
        return e2e_binary.main_directory_structure.build(dict(
            magic2="MDbMDir", version=0x64, unknown=[0] * 10, num_entries=num_entries,
            current=current, prev=prev, unknown3=0))

    out = e2e_binary.header_structure.build(dict(magic1="CMDb", version=0x64, unknown=[0] * 10))
    out += directory(0, current=block, prev=block)  # oct-converter follows current, eyepy prev
    out += directory(len(chunks), current=block, prev=0)
    entries, data, start = b"", b"", first_chunk
    for number, (kind, slice_id, ind, ids, payload) in enumerate(chunks):
        entries += e2e_binary.sub_directory_structure.build(dict(
            pos=block + directory_size + number * entry_size, start=start, size=len(payload),
            unknown=0, slice_id=slice_id, unknown2=0, unknown3=0, type=kind, unknown4=0, **ids))
        data += e2e_binary.chunk_structure.build(dict(
            magic3="MDbData", unknown=0, unknown2=0, pos=start, size=len(payload), unknown3=0,
            slice_id=slice_id, ind=ind, unknown4=0, type=kind, unknown5=0, **ids)) + payload
        start += chunk_header_size + len(payload)
    return out + entries + data


# --- Bioptigen .OCT -----------------------------------------------------------
# A header of (key length, key, data length, value) fields, then one frame per
# B-scan: its own fields, then ``linelength x framelines`` uint16 samples
# stored A-scan by A-scan. Both the header and each frame end with 4 bytes
# that oct-converter's structures leave unnamed (so construct cannot build
# them from a dict); they are built alone here. oct-converter returns, for a
# rectangular scan (scantype 1), one volume per "frame" holding "scans"
# B-scans, each B-scan as [A-scans, samples], i.e. [W, H]. It records no
# pixel spacing, although the header has scan lengths.

BOCT_MAGIC, BOCT_VERSION = 209561509, 266  # a real file's, per OCT-Converter issue #77; not checked


def _boct_field(key: str, **rest) -> dict:
    return dict(keylength=len(key), key=key, **rest)


def boct_bytes(volume: np.ndarray, scan_length_mm: float, scan_depth_mm: float,
               el_scan_length_mm: float) -> bytes:
    """A Bioptigen .OCT file: one rectangular volume of uint16 B-scans, no patient fields."""
    import construct
    from oct_converter.readers.binary_structs import boct_binary as boct

    slices, height, width = volume.shape

    def integer(key, value):
        return _boct_field(key, dataLength=4, value=value)

    def number(key, value):
        return _boct_field(key, dataLength=8, value=value)

    def text(key, value):
        return _boct_field(key, dataLength=len(value.encode()), value=value)

    header = dict(
        magicNumber=BOCT_MAGIC, version=BOCT_VERSION,
        frameheader=_boct_field("FRAMEHEADER", dataLength=0),
        framecount=integer("FRAMECOUNT", slices), linecount=integer("LINECOUNT", slices * width),
        linelength=integer("LINELENGTH", height), sampleformat=integer("SAMPLEFORMAT", 2),
        description=text("DESCRIPTION", "octfw test volume"),
        xmin=number("XMIN", 0.0), xmax=number("XMAX", scan_length_mm), xcaption=text("XCAPTION", "mm"),
        ymin=number("YMIN", 0.0), ymax=number("YMAX", scan_depth_mm), ycaption=text("YCAPTION", "mm"),
        scantype=integer("SCANTYPE", 1), scandepth=number("SCANDEPTH", scan_depth_mm),
        scanlength=number("SCANLENGTH", scan_length_mm), azscanlength=number("AZSCANLENGTH", scan_length_mm),
        elscanlength=number("ELSCANLENGTH", el_scan_length_mm), objectdistance=number("OBJECTDISTANCE", 0.0),
        scanangle=number("SCANANGLE", 0.0), scans=integer("SCANS", slices), frames=integer("FRAMES", 1),
        dopplerflag=integer("DOPPLERFLAG", 0), config=_boct_field("CONFIG", dataLength=4, value=b"\0" * 4),
    )
    named_header = construct.Struct(*boct.bioptigen_oct_header_struct.subcons[:-1])
    trailer = boct.bioptigen_oct_header_struct.subcons[-1].build(0)
    out = named_header.build(header) + trailer
    when = dict(year=CAPTURED.year, month=CAPTURED.month, dow=0, day=CAPTURED.day, hour=CAPTURED.hour,
                minute=CAPTURED.minute, second=CAPTURED.second, millisecond=0)
    for index, bscan in enumerate(volume):
        pixels = np.ascontiguousarray(bscan.T).astype("<u2").tobytes()  # A-scan by A-scan
        out += boct.oct_frame_header_struct.build(dict(
            framedata=_boct_field("FRAMEDATA", dataLength=0),
            framedatetime=_boct_field("FRAMEDATETIME", dataLength=16, value=when),
            frametimestamp=number("FRAMETIMESTAMP", float(index)),
            framelines=integer("FRAMELINES", width),
            keylength=len("FRAMESAMPLES"), key="FRAMESAMPLES", dataLength=len(pixels),
        )) + pixels + boct.oct_frame_struct.subcons[-1].build(0)
    return out
