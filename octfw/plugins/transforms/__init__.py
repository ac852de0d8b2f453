"""Transforms (recipe table ``[transform]``).

- :mod:`octfw.plugins.transforms.oct_standard`: the ``oct-standard`` transform
  (resample, normalise, fit, augment, and the patch masks of
  :mod:`octfw.models.masks`).
"""
