"""Field types and validators shared by component config classes.

Config classes are frozen attrs classes; the recipe loader structures a TOML
table into one with cattrs, refusing unknown keys. These helpers keep the
common checks (positive numbers, lengths, locations) one line each.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

__all__ = ["Location", "NULL_WORDS", "STAGE_METADATA", "positive", "non_negative", "in_range", "length",
           "choices", "doc", "component_table", "parse_bytes", "byte_size"]

#: Strings (stripped, lower-cased) that mean "no value": a Location refuses them.
NULL_WORDS = frozenset({"none", "null", "nil", ""})

#: attrs metadata key of a field holding a nested component table: its value is the stage.
STAGE_METADATA = "octfw_stage"


class Location(str):
    """A local path or fsspec URL (``gs://bucket/x``, ``file:///x``).

    The recipe loader resolves a relative local path against the recipe's
    folder, and refuses ``"None"``, ``"null"`` and the empty string: the seeds'
    ``ckpt_dir: null`` became a bucket named "None". To mean "no location",
    leave the key out (the field's default is then ``None``).
    """

    @property
    def is_remote(self) -> bool:
        return "://" in self and not self.startswith("file://")

    @property
    def local_path(self) -> str:
        """The filesystem path of a local location (``file://`` stripped)."""
        return self[len("file://"):] if self.startswith("file://") else str(self)


def positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"must be > 0, got {value!r}")


def non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not value >= 0:
        raise ValueError(f"must be >= 0, got {value!r}")


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """Validator for ``low <= value <= high`` (open ends excluded)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        ok_low = value > low if low_open else value >= low
        ok_high = value < high if high_open else value <= high
        if not (ok_low and ok_high):
            lo = "(" if low_open else "["
            hi = ")" if high_open else "]"
            raise ValueError(f"must be in {lo}{low}, {high}{hi}, got {value!r}")

    return check


def length(n: int):
    """Validator for a sequence of exactly ``n`` items."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and len(value) != n:
            raise ValueError(f"must have {n} values, got {len(value)}: {list(value)!r}")

    return check


def choices(*allowed: str):
    """Validator for one of ``allowed`` (the message lists them)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")

    return check


# Sizes are parsed here rather than by dask.utils.parse_bytes (which reads the
# same units): importing dask takes about 0.4 s, and validating a recipe, which
# checks every size field, must stay instant and import nothing heavy. This is
# octfw's one size parser; the device-memory option of `octfw check` uses it too.
_BYTE_UNITS = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(value: int | str) -> int:
    """A size in bytes, from an int or a string; ValueError naming the value otherwise.

    ``"20GiB"``, ``"500 MB"``, ``"80g"``, ``"1.5TiB"``, ``"0"``: k, M, G and T
    (with or without B) are powers of 1000, KiB, MiB, GiB and TiB powers of
    1024, a number alone is bytes; case does not matter. 0 is a size (a cache
    that is off); a negative size is not.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = isinstance(value, str) and re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        size = int(float(match.group(1)) * _BYTE_UNITS[unit]) if unit in _BYTE_UNITS else -1
    if size < 0:
        raise ValueError(f"{value!r} is not a size in bytes; write it like 20GiB, 500MB or 0")
    return size


def byte_size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """Validator for a size :func:`parse_bytes` reads (the field keeps the value as written)."""
    parse_bytes(value)


def doc(text: str, **kwargs: Any) -> Any:
    """An ``attrs.field`` carrying its documentation, shown by ``octfw list``."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["doc"] = text
    return attrs.field(metadata=metadata, **kwargs)


def component_table(stage: str, text: str, **kwargs: Any) -> Any:
    """A documented field holding a nested ``stage`` component table (``{ name = "...", ... }``).

    The recipe loader checks the table against the registry and stores it
    resolved: plain data with every default filled in.
    """
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[STAGE_METADATA] = stage
    return doc(text, metadata=metadata, **kwargs)
