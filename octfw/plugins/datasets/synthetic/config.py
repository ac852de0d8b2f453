"""Config of the ``synthetic-oct`` component (light: attrs only).

It lives below the implementation that reads it (:mod:`.cohort` and the
modules it draws with, which import numpy), so it names the choices a recipe
may make itself: validating a recipe must not import numpy.
:mod:`octfw.plugins.datasets.synthetic` registers it and holds the factory;
a test checks that these names are the cohort's.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import Location, choices, doc, in_range, non_negative, positive

#: The vendor domains a cohort draws (each a profile in :data:`.vendors.PROFILES`).
DOMAINS: tuple[str, ...] = ("heidelberg", "topcon", "zeiss")
#: Volume sizes (:data:`.vendors.SIZES`): "small" for the CPU, "device" as devices export.
SIZE_NAMES: tuple[str, ...] = ("small", "device")
#: Labelled tasks (:data:`.labels.TASKS`).
TASK_NAMES: tuple[str, ...] = ("lesion", "fluid", "thinning", "finding")


def _domains(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("must name at least one domain")
    if len(set(value)) != len(value):
        raise ValueError(f"must not repeat a domain, got {list(value)!r}")
    unknown = [d for d in value if d not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown domains {unknown!r}; known: {sorted(DOMAINS)!r}")


def _task(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in TASK_NAMES:
        raise ValueError(f"must be one of {', '.join(TASK_NAMES)}, got {value!r}")
    if value != "lesion" and not instance.labels:
        raise ValueError(f"task {value!r} draws findings only with labels = true")


def _finding_scale(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    positive(instance, attribute, value)
    if value != 1.0 and not instance.labels:
        raise ValueError("scales findings, which are drawn only with labels = true")


@attrs.frozen
class SyntheticOctConfig:
    n_volumes: int = doc("Number of volumes in the cohort.", default=32, validator=positive)
    domains: tuple[str, ...] = doc(
        "Vendor domains, assigned in turn: heidelberg, topcon, zeiss "
        "(each with its own volume size, spacing, gain and speckle).",
        default=DOMAINS,
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
        "Give each volume a label of `task` and the finding it names, recorded in the manifest.",
        default=False,
    )
    task: str = doc(
        "With labels: lesion (a bright lesion, 1, or none, 0), fluid (sub-retinal fluid, "
        "1, or none), thinning (outer nuclear layer thinned over a region, 1, or none), "
        "or finding (multi-class: 0 none, 1 lesion, 2 fluid, 3 thinning). "
        "Sizes and how they were chosen: docs/tasks.md.",
        default="lesion",
        validator=_task,
    )
    finding_scale: float = doc(
        "With labels: multiplies the finding's size (1.0: as sized in docs/tasks.md).",
        default=1.0,
        validator=_finding_scale,
    )
    sizes: str = doc(
        "small (16-bit volumes of about 0.1 M voxels that the CPU quickstart decodes quickly) "
        "or device (8-bit, log-scaled, at the sizes devices export: heidelberg 49 x 496 x 512, "
        "topcon 128 x 885 x 512, zeiss 128 x 1024 x 512; 12 to 67 MB a file, for preparation "
        "and streaming benchmarks).",
        default="small",
        validator=choices(*SIZE_NAMES),
    )
    folder: Location | None = doc(
        "Where the cohort is written; unset: <cache_dir>/synthetic-oct/<options key>.",
        default=None,
    )
