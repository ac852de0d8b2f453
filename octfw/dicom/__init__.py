"""OCT volumes stored as DICOM: what every dataset that reads or writes them shares.

Core, not a plugin's, so that a third-party dataset reads and writes DICOM
through the same public modules the built-in ones use (no plugin imports
another: pyproject.toml's import contracts):

- :mod:`octfw.dicom.decoding`: decode one OCT DICOM file into a
  :class:`~octfw.types.Sample` (every failure a :class:`~octfw.display.errors.CorruptFile`);
- :mod:`octfw.dicom.series`: assemble one volume from a series of single-frame
  files, one B-scan each;
- :mod:`octfw.dicom.header`: parse a file, and read its header without pixels
  (domain, series, voxel spacing);
- :mod:`octfw.dicom.writing`: encode a volume as an Ophthalmic Tomography file,
  and write it;
- :mod:`octfw.dicom.files`: open a file's bytes or write them whole, local or
  remote (fsspec);
- :mod:`octfw.dicom.manifest`: the manifest, a CSV or JSON-lines list of a
  cohort's volumes (path, domain, split, label, patient, masks), which
  ``oct-vendor`` reads for its files too;
- :mod:`octfw.dicom.masks`: a manifest's finding masks and layer labels;
- :mod:`octfw.dicom.dataset`: :class:`~octfw.dicom.dataset.DicomDataset`, the
  dataset of a folder, glob or manifest of DICOM files, which ``dicom``,
  ``synthetic-oct`` and ``phantom-oct`` build, and the file listing
  (:func:`~octfw.dicom.dataset.list_dicom_files`) ``oct-vendor`` shares.

This module imports nothing; :mod:`~octfw.dicom.files` and
:mod:`~octfw.dicom.manifest` import no numpy, each of the others does (pydicom
when it reads or writes a file).
"""
