"""Datasets (recipe table ``[dataset]``).

One package per dataset, holding its config (``config.py``, attrs only:
what validating a recipe imports), its code, and in ``__init__.py`` its
factory and registration:

- :mod:`octfw.plugins.datasets.dicom`: OCT DICOM volumes from a folder, glob or
  manifest, read by the core's :mod:`octfw.dicom`, which the others build on
  too (no dataset imports another).
- :mod:`octfw.plugins.datasets.synthetic`: a synthetic multi-vendor cohort written as
  DICOM.
- :mod:`octfw.plugins.datasets.phantom`: two more synthetic families written as DICOM
  (``tuning``: drusen; ``held-out``: intraretinal cysts), drawn by code that
  shares nothing with ``synthetic`` but the DICOM writer.
- :mod:`octfw.plugins.datasets.vendor`: raw vendor files through oct-converter.
- :mod:`octfw.plugins.datasets.prepared`: the zarr store ``octfw prepare`` writes on a
  Dask cluster, and its streaming reader.
"""
