"""OCT volumes stored as DICOM: what every dataset that reads or writes them shares.

Core, not a plugin's, so that a third-party dataset reads and writes DICOM
through the same public modules the built-in ones use (no plugin imports
another: pyproject.toml's import contracts):

- :mod:`octfw.dicom.reader`: decode one OCT DICOM file or series into a
  :class:`~octfw.types.Sample` (every failure a :class:`~octfw.display.errors.CorruptFile`),
  read a header without pixels, encode and write a volume;
- :mod:`octfw.dicom.manifest`: the manifest, a CSV or JSON-lines list of a
  cohort's volumes (path, domain, split, label, patient, masks), which
  ``oct-vendor`` reads for its files too;
- :mod:`octfw.dicom.masks`: a manifest's finding masks and layer labels;
- :mod:`octfw.dicom.dataset`: :class:`~octfw.dicom.dataset.DicomDataset`, the
  dataset of a folder, glob or manifest of DICOM files, which ``dicom``,
  ``synthetic-oct`` and ``phantom-oct`` build, and the file listing
  (:func:`~octfw.dicom.dataset.list_dicom_files`) ``oct-vendor`` shares.

This module imports nothing; each of the others imports numpy (pydicom
when it reads or writes a file).
"""
