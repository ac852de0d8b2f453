"""What a synthetic cohort's volumes are labelled with: a finding per task, a layer per voxel.

Labelled cohorts carry one of three retinal findings (or none), as a
classification task (see :data:`TASKS`): a bright lesion, sub-retinal fluid
(a dark dome that lifts the retina off the pigment epithelium) or thinning
of the outer nuclear layer over a region (drawn in :mod:`.retina`). Their
sizes were fixed by measurement before any pretrained encoder was probed on
them; see docs/tasks.md and benchmarks/learning/synthetic_tasks.py.

Every "small" cohort writes, beside each volume, the label of its retinal layers
(:data:`LAYER_NAMES`, :func:`layer_labels`), named by the manifest's ``layers`` and
``layer_names`` columns; a consumer reads them through the dataset
(:class:`octfw.types.LayeredDataset`: ``dataset.layers(i)``, uint8 ``[D, H, W]``, and
``dataset.layer_names(i)``) and brings them to the prepared geometry with
``transform.prepare_labels(labels, dataset.load(i))``
(:class:`octfw.types.LabelPreparingTransform`). "device" cohorts, written for byte
benchmarks, carry none (67 MB of labels a volume).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["TASKS", "task_labels", "LAYER_NAMES", "layer_labels"]

#: Labelled tasks: task -> the finding of each label (None: a healthy retina).
#: "lesion", "fluid" and "thinning" are binary (label 1: the finding is there,
#: in about half the volumes); "finding" is multi-class, one of the four in
#: about a quarter of the volumes each.
TASKS: dict[str, tuple[str | None, ...]] = {
    "lesion": (None, "lesion"),
    "fluid": (None, "fluid"),
    "thinning": (None, "thinning"),
    "finding": (None, "lesion", "fluid", "thinning"),
}


def task_labels(task: str) -> tuple[str | None, ...]:
    """The finding of each label of ``task`` (index = label; None: no finding)."""
    try:
        return TASKS[task]
    except KeyError:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(TASKS)}") from None


#: The labels of :func:`layer_labels` (index = label value), top to bottom: the
#: vitreous above the inner limiting membrane, the eight drawn layers (the
#: photoreceptors as their ellipsoid and interdigitation zones), sub-retinal fluid
#: (empty but over a fluid dome) and the choroid (everything below the pigment
#: epithelium). Stable: new labels are only ever appended.
LAYER_NAMES: tuple[str, ...] = ("vitreous", "NFL", "GCL+IPL", "INL", "OPL", "ONL", "EZ", "IZ", "SRF", "RPE",
                                "choroid")


def layer_labels(layers: Sequence[tuple[np.ndarray, np.ndarray, float]], shape: Sequence[int]) -> np.ndarray:
    """The label of :data:`LAYER_NAMES` of every voxel, uint8 ``shape`` ``[D, H, W]``.

    ``layers`` are the drawn (top, bottom, reflectivity) of :data:`.retina._LAYERS`, positions
    ``[D, 1, W]`` in units of H (voxel ``j`` of an A-scan at ``j / (H - 1)``, as the
    renderers place it). A voxel's label is the number of boundaries at or above it:
    the inner surface, each layer's bottom, the pigment epithelium's top (below the
    photoreceptors' bottom only over sub-retinal fluid: label SRF in between) and its
    bottom. The boundaries never cross, so labels rise monotonically down every A-scan.
    """
    depth, height, width = (int(n) for n in shape)
    y = np.linspace(0.0, 1.0, height)[None, :, None]
    boundaries = [layers[0][0]] + [bottom for _top, bottom, _r in layers[:-1]] + [layers[-1][0], layers[-1][1]]
    labels = np.zeros((depth, height, width), dtype=np.uint8)
    for boundary in boundaries:
        labels += np.broadcast_to(y >= boundary, labels.shape)
    return labels
