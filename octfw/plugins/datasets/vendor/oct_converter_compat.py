"""Make oct-converter's readers work on numpy >= 2.3.

oct-converter 0.7.0 (the latest release on PyPI) reads Topcon ``.fds`` /
``.fda`` chunks, and the B-scans of its older ``e2e_Wedward`` Heidelberg
reader, with ``np.fromstring(raw_bytes, dtype=...)``. numpy deprecated that
binary mode long ago and removed it in 2.3 (it now raises ValueError), so
on a current numpy those readers fail on every file; upstream still calls
it.

The global ``numpy`` module is left alone: only the ``np`` name inside those
reader modules is pointed at :data:`NUMPY_PROXY`, a module object that
forwards every attribute to numpy except ``fromstring``, whose binary mode
becomes ``np.frombuffer(...).copy()`` (a copy because ``fromstring``
returned a writable array that owned its memory). :func:`patch_oct_converter`
does this once, and only when binary ``fromstring`` is actually gone.
Remove this module when an oct-converter release stops calling
``np.fromstring``.
"""

from __future__ import annotations

import importlib
import types
import warnings
from typing import Any

import numpy as np

__all__ = ["NUMPY_PROXY", "binary_fromstring_works", "patch_oct_converter"]

#: The oct-converter modules that call ``np.fromstring`` in binary mode.
MODULES = (
    "oct_converter.readers.fds",
    "oct_converter.readers.fda",
    "oct_converter.readers.e2e_Wedward",
)


def _fromstring(data: Any, dtype: Any = float, count: int = -1, sep: str = "", **kwargs: Any) -> np.ndarray:
    if sep == "":
        return np.frombuffer(data, dtype=dtype, count=count).copy()
    return np.fromstring(data, dtype=dtype, count=count, sep=sep, **kwargs)


class _NumpyProxy(types.ModuleType):
    """numpy, with the binary ``fromstring`` that numpy 2.3 removed."""

    fromstring = staticmethod(_fromstring)

    def __getattr__(self, name: str) -> Any:  # only called for names not set here
        return getattr(np, name)


NUMPY_PROXY = _NumpyProxy("octfw_numpy_fromstring_proxy", __doc__)


def binary_fromstring_works() -> bool:
    """Whether this numpy still has ``np.fromstring``'s binary mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy < 2.3 warns that the mode is deprecated
        try:
            np.fromstring(b"\0", dtype=np.uint8)
        except ValueError:
            return False
    return True


def patch_oct_converter() -> list[str]:
    """Point the ``np`` of oct-converter's fromstring-using readers at the proxy.

    Does nothing when binary ``fromstring`` still works; safe to call any
    number of times. Returns the modules whose ``np`` is the proxy now.
    """
    if binary_fromstring_works():
        return []
    patched = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a later oct-converter may drop or rename a reader
            continue
        if getattr(module, "np", None) is np:
            module.np = NUMPY_PROXY
        if getattr(module, "np", None) is NUMPY_PROXY:
            patched.append(name)
    return patched
