"""Config of the ``synthetic-oct`` component (light: attrs only).

It lives below the implementation that reads it; the plugin module
:mod:`octfw.plugins.datasets.synthetic_oct` registers it and holds the factory.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.fields import Location, doc, in_range, non_negative, positive


def _domains(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    from octfw.data.synthetic import PROFILES

    if not value:
        raise ValueError("must name at least one domain")
    if len(set(value)) != len(value):
        raise ValueError(f"must not repeat a domain, got {list(value)!r}")
    unknown = [d for d in value if d not in PROFILES]
    if unknown:
        raise ValueError(f"unknown domains {unknown!r}; known: {sorted(PROFILES)!r}")


@attrs.frozen
class SyntheticOctConfig:
    n_volumes: int = doc("Number of volumes in the cohort.", default=32, validator=positive)
    domains: tuple[str, ...] = doc(
        "Vendor domains, assigned in turn: heidelberg, topcon, zeiss "
        "(each with its own volume size, spacing, gain and speckle).",
        default=("heidelberg", "topcon", "zeiss"),
        validator=_domains,
    )
    seed: int | None = doc(
        "Seed of the cohort; unset: the run's seed. Same seed, same bytes.",
        default=None,
        validator=non_negative,
    )
    corrupt_fraction: float = doc(
        "Fraction of files written broken (truncated, not DICOM, no pixel data, "
        "constant) to exercise quarantine.",
        default=0.0,
        validator=in_range(0.0, 1.0),
    )
    labels: bool = doc(
        "Give each volume a lesion (label 1) or none (label 0), recorded in the manifest.",
        default=False,
    )
    folder: Location | None = doc(
        "Where the cohort is written; unset: <cache_dir>/synthetic-oct/<options key>.",
        default=None,
    )
