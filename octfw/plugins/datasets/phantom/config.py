"""Config of the ``phantom-oct`` component (light: attrs only).

Validating a recipe must not import numpy, so the choices a recipe may make
are named here; :mod:`.cohort` checks that they are its families'.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import Location, choices, doc, non_negative, positive

#: Each family's one binary task: the finding its positive volumes carry.
FAMILY_TASKS: dict[str, str] = {"tuning": "drusen", "held-out": "cysts", "context": "reversal"}
#: The layers each family labels in every volume, top to bottom: voxel label k is the k-th name (the
#: manifest's ``layers`` and ``layer_names``, which the layer-segmentation evaluator reads). Here,
#: not beside each family's drawing code, so that a listing names them without importing numpy.
FAMILY_LAYERS: dict[str, tuple[str, ...]] = {
    "tuning": ("vitreous", "NFL", "GCL", "IPL", "INL", "OPL", "ONL", "photoreceptors", "RPE", "drusen", "choroid"),
    "held-out": ("vitreous", "NFL", "GCL", "IPL", "INL", "OPL", "ONL", "IS/OS", "RPE", "choroid"),
    "context": ("vitreous", "NFL", "GCL+IPL", "INL", "OPL", "ONL", "photoreceptors", "RPE", "choroid"),
}


def _task(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    expected = FAMILY_TASKS.get(instance.family)
    if value is not None and expected is not None and value != expected:
        raise ValueError(f"family {instance.family!r} has the one task {expected!r}, got {value!r}")


@attrs.frozen
class PhantomOctConfig:
    family: str = doc(
        "tuning (drusen: bumps of the pigment epithelium; vendors optovue, nidek, canon) or "
        "held-out (cysts: small dark pockets in the inner retina; vendors optopol, bioptigen, "
        "moptim) or context (reversal: a normal eye's inner retina is brighter below the fovea than "
        "above it, a positive eye's the other way round (the same reflectivities, halves swapped); vendors "
        "tomey, visionix, thorlabs; sized by benchmarks/learning/context_task.py). Drawn by code that shares "
        "nothing with synthetic-oct's renderer, so a lever tuned on one family can be checked on the others. "
        "Every volume also carries voxel labels of its retinal layers (for the layer-segmentation evaluator), "
        "label k the k-th of: " + "; ".join(f"{family}: {', '.join(names)}" for family, names in FAMILY_LAYERS.items())
        + ".",
        default="tuning",
        validator=choices(*FAMILY_TASKS),
    )
    n_volumes: int = doc("Number of volumes; two per patient (both eyes).", default=32, validator=positive)
    seed: int | None = doc(
        "Seed of the cohort; unset: the run's seed. Same seed, same bytes.",
        default=None,
        validator=non_negative,
    )
    labels: bool = doc(
        "Record each volume's label of the family's task in the manifest (about half the "
        "volumes carry the finding either way).",
        default=False,
    )
    task: str | None = doc(
        "The family's task (drusen, cysts or reversal); unset: the family's. Named only to make a recipe "
        "say what it measures. Sizes and how they were chosen: benchmarks/learning/phantom_tasks.py.",
        default=None,
        validator=_task,
    )
    finding_scale: float = doc(
        "Multiplies the finding's size (1.0: as sized by benchmarks/learning/phantom_tasks.py).",
        default=1.0,
        validator=positive,
    )
    folder: Location | None = doc(
        "Where the cohort is written; unset: <cache_dir>/phantom-oct/<options key>.",
        default=None,
    )
