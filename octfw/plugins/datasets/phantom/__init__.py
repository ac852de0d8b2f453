"""The ``phantom-oct`` dataset: synthetic OCT families independent of ``synthetic-oct``.

Every pretraining lever was first tuned on tasks drawn by ``synthetic-oct``'s
renderer; these families are drawn by code that shares nothing with it but
the DICOM writer and the manifest (their own layers, reflectivity, speckle,
vendors and findings), so a lever can be checked on data it was not tuned
on. ``tuning`` (drusen) and ``held-out`` (intraretinal cysts) differ from
each other as much as from ``synthetic-oct``; ``context`` carries a finding
that only the relation of the retina's regions defines (sized by
``benchmarks/learning/context_task.py``). Each patient has two eyes, so
evaluation splits whole patients (the manifest's ``patient`` column).

Registration and factory; the config lives in :mod:`octfw.plugins.datasets.phantom.config`,
the writing in :mod:`.cohort`, each family in its own module.
"""

from __future__ import annotations

from octfw.plugins.datasets.phantom.config import PhantomOctConfig
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Dataset

__all__ = ["PhantomOctConfig", "build"]


def build(config: PhantomOctConfig, ctx: BuildContext) -> Dataset:
    from octfw.dicom.dataset import DicomDataset
    from octfw.plugins.datasets.phantom.cohort import cohort_key, cohort_options, write_phantom_cohort

    seed = ctx.seed if config.seed is None else config.seed
    if config.folder is not None:
        from octfw.storage.reach import require_reachable

        folder = str(config.folder).rstrip("/")
        require_reachable(folder, "dataset.folder")  # seconds, not gcsfs's minute of retries
    else:
        options = cohort_options(config.family, config.n_volumes, seed, config.labels, config.finding_scale)
        folder = str(ctx.cache_dir / "phantom-oct" / cohort_key(options))
    manifest = write_phantom_cohort(folder, config.family, config.n_volumes, seed=seed, labels=config.labels,
                                    finding_scale=config.finding_scale)
    return DicomDataset.from_location(manifest, domain_from="header")


@hookimpl
def octfw_register_datasets(register: Register) -> None:
    register(
        "phantom-oct",
        PhantomOctConfig,
        build,
        "Three synthetic OCT families (tuning: drusen; held-out: cysts; context: reversal) drawn independently of "
        "synthetic-oct, two eyes per patient, written as DICOM and read like `dicom`.",
    )
