"""Datasets and transforms (recipe tables ``[dataset]`` and ``[transform]``).

One package per component, holding its config (``config.py``, attrs only:
what validating a recipe imports), its code, and in ``__init__.py`` its
factory and registration:

- :mod:`octfw.data.dicom`: OCT DICOM volumes from a folder, glob or
  manifest; the DICOM reader the others build on.
- :mod:`octfw.data.synthetic`: a synthetic multi-vendor cohort written as
  DICOM.
- :mod:`octfw.data.phantom`: two more synthetic families written as DICOM
  (``tuning``: drusen; ``held-out``: intraretinal cysts), drawn by code that
  shares nothing with ``synthetic`` but the DICOM writer.
- :mod:`octfw.data.vendor`: raw vendor files through oct-converter.
- :mod:`octfw.data.prepared`: the zarr store ``octfw prepare`` writes on a
  Dask cluster, and its streaming reader.
- :mod:`octfw.data.oct_standard`: the ``oct-standard`` transform and its
  masks.
"""
