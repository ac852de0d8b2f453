"""A dataset's domains and what it lists, counted without decoding pixels, and the run's one line on them.

Position ``i`` of :func:`dataset_domains` is domain id ``i`` (the batch's
``domain_id``); :func:`domain_report` is the line a run starts with.
"""

from __future__ import annotations

from octfw.types import Dataset, DomainCountingDataset, SeriesDataset

__all__ = ["dataset_domains", "domain_counts", "domain_report", "listed"]


def dataset_domains(dataset: Dataset) -> list[str]:
    """The dataset's domain names, sorted: position i is domain id i."""
    return sorted(domain_counts(dataset))


def domain_counts(dataset: Dataset) -> dict[str, int]:
    """Files (dataset entries) per domain, sorted by domain name (without decoding pixels)."""
    if isinstance(dataset, DomainCountingDataset):
        return dict(dataset.domain_counts())
    counts: dict[str, int] = {}
    for index in range(len(dataset)):
        domain = dataset.domain(index)
        counts[domain] = counts.get(domain, 0) + 1
    return dict(sorted(counts.items()))


def listed(dataset: Dataset) -> str:
    """What a dataset lists, before any file is read: ``48 files``, or ``40 files and
    8 series`` (of single-frame files). Files, not samples or volumes: which of them
    hold a usable volume is known only once they are read (others are quarantined)."""
    series = sum(1 for i in range(len(dataset)) if dataset.is_series(i)) if isinstance(dataset, SeriesDataset) else 0
    files = len(dataset) - series
    text = f"{files} file{'' if files == 1 else 's'}"
    return f"{text} and {series} series" if series else text


def domain_report(dataset: Dataset, domain_sampling: str = "natural") -> str:
    """One line for the start of a run: files per domain, and how they are drawn.

    For example ``dataset: 48 files in 3 domains: heidelberg 16, topcon 16,
    zeiss 16 (natural sampling)``.
    """
    counts = domain_counts(dataset)
    noun = "domain" if len(counts) == 1 else "domains"
    per_domain = ", ".join(f"{domain} {count}" for domain, count in counts.items())
    return (f"dataset: {listed(dataset)} in {len(counts)} {noun}: {per_domain} "
            f"({domain_sampling} sampling)")
