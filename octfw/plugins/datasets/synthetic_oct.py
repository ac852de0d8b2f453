"""The ``synthetic-oct`` dataset: a generated multi-vendor cohort.

The cohort is written once as Ophthalmic Tomography DICOM files (and reused
while its options are unchanged), then read back by the same
:class:`~octfw.data.dicom_dataset.DicomDataset` as the ``dicom`` dataset, so
a quickstart on synthetic data exercises the real DICOM path end to end.
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


def build(config: SyntheticOctConfig, ctx: Any):
    from octfw.data.dicom_dataset import DicomDataset
    from octfw.data.synthetic import MANIFEST_FILE, cohort_key, cohort_options, write_synthetic_cohort

    seed = ctx.seed if config.seed is None else config.seed
    options = dict(
        seed=seed,
        corrupt_fraction=config.corrupt_fraction,
        with_labels=config.labels,
    )
    if config.folder is not None:
        folder = str(config.folder)
    else:
        key = cohort_key(cohort_options(config.n_volumes, config.domains, **options))
        folder = str(ctx.cache_dir / "synthetic-oct" / key)
    write_synthetic_cohort(folder, config.n_volumes, config.domains, **options)
    return DicomDataset.from_location(f"{folder.rstrip('/')}/{MANIFEST_FILE}", domain_from="header")
