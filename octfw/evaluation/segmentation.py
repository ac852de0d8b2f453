"""Volumes with finding masks, prepared as in training: the data of a dense evaluator.

The dense counterpart of :func:`octfw.evaluation.features.load_labelled`: every
volume of a :class:`~octfw.types.MaskedDataset` is decoded and prepared once
(:func:`~octfw.evaluation.features.prepare_volume`), and its finding mask brought
to the same geometry by the transform's ``prepare_mask``
(:class:`~octfw.types.MaskPreparingTransform`). Each volume's label is whether
its prepared mask holds any of the finding, so the split is stratified by
(domain, finding or not) and ``octfw eval --shots k`` draws ``k`` volumes with
the finding and ``k`` without.

Masks are never dropped quietly: a volume without a mask, a mask file that
cannot be read, or one of another shape than its volume is a
:class:`~octfw.display.errors.UserError` naming the file. A volume file that cannot be
read is skipped and counted in one warning, as for the classification evaluators.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import attrs
import numpy as np

from octfw.display.errors import ContractError, CorruptFile, UserError
from octfw.evaluation.classification import build_from_table, check_patients_disjoint
from octfw.evaluation.features import prepare_volume
from octfw.display.tables import counted
from octfw.types import MaskedDataset, MaskPreparingTransform, NamingDataset, PatientDataset

__all__ = ["DenseInputs", "dense_inputs", "MaskedVolumes", "check_masks_early", "load_masked"]

logger = logging.getLogger(__name__)


def _name(dataset: Any, index: int) -> str:
    return dataset.url(index) if isinstance(dataset, NamingDataset) else f"volume {index}"


def check_masks_early(dataset: Any, transform: Any, where: str) -> None:
    """Refuse, before any volume is decoded, a dataset without masks (or with some volumes
    lacking one) and a transform that cannot prepare a mask."""
    missing = [] if not isinstance(dataset, MaskedDataset) else \
        [i for i in range(len(dataset)) if dataset.mask_source(i) is None]
    if not isinstance(dataset, MaskedDataset) or len(missing) == len(dataset):
        raise UserError(f"{where}: the dataset has no finding masks; use a manifest with a mask column "
                        "(dataset = { name = \"dicom\", path = \"cohort.jsonl\" }) or phantom-oct")
    if missing:
        raise UserError(f"{where}: {len(missing)} of {counted(len(dataset), 'volume')} have no finding mask "
                        f"(first: {_name(dataset, missing[0])}); give every manifest row a mask (an empty "
                        "one for a volume without the finding)")
    if not isinstance(transform, MaskPreparingTransform):
        raise UserError(f"{where}: the training transform {type(transform).__name__} cannot bring a finding "
                        "mask to its prepared volumes (it has no prepare_mask); oct-standard can")


@attrs.define
class MaskedVolumes:
    """Usable volumes of one dataset with their prepared finding masks."""

    indices: list[int]  #: dataset indices, in order
    labels: np.ndarray  #: int64 [N]: 1 where the prepared mask holds any of the finding
    domains: list[str]
    sources: list[str]
    volumes: list[np.ndarray]  #: float32 [C, D, H, W], prepared as in training
    masks: list[np.ndarray]  #: bool [D, H, W], the volume's geometry
    #: one key per volume, equal for the volumes of one patient; None: the dataset knows no patients
    groups: list[str] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def arrays(self) -> Iterator[np.ndarray]:
        """The prepared volumes, as :func:`octfw.evaluation.features.map_volumes` reads them."""
        return iter(self.volumes)

    def subset(self, positions: Sequence[int]) -> "MaskedVolumes":
        positions = list(positions)
        return MaskedVolumes(
            [self.indices[p] for p in positions], self.labels[positions], [self.domains[p] for p in positions],
            [self.sources[p] for p in positions], [self.volumes[p] for p in positions],
            [self.masks[p] for p in positions], None if self.groups is None else [self.groups[p] for p in positions],
        )


def load_masked(dataset: Any, transform: Any, *, where: str) -> MaskedVolumes:
    """Decode and prepare every volume and its mask once (see the module docstring)."""
    check_masks_early(dataset, transform, where)
    patient_of = dataset.patient if isinstance(dataset, PatientDataset) else None
    indices, domains, sources, volumes, masks, groups, skipped = [], [], [], [], [], [], []
    for index in range(len(dataset)):
        try:
            sample = dataset.load(index)
            volume = prepare_volume(transform, sample)
        except CorruptFile as bad:
            skipped.append(f"{bad.url}: {bad.reason}")
            continue
        mask_source = dataset.mask_source(index)
        try:
            mask = dataset.mask(index)
        except CorruptFile as bad:  # the volume is fine: its mask must be fixed, not skipped
            raise UserError(f"{where}: {bad}") from None
        if mask is None:
            raise UserError(f"{where}: {sample.provenance.source} has no finding mask")
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != np.shape(sample.volume):
            raise UserError(f"{where}: {mask_source}: the finding mask has shape {list(mask.shape)}, its volume "
                            f"{list(np.shape(sample.volume))}{_reversed_hint(mask_source, mask.shape, sample)}")
        try:
            prepared_mask = np.asarray(transform.prepare_mask(mask, sample), dtype=bool)
        except ContractError as bad:
            raise UserError(f"{where}: {mask_source}: {bad}") from None
        indices.append(index)
        domains.append(sample.provenance.domain)
        sources.append(sample.provenance.source)
        volumes.append(volume)
        masks.append(prepared_mask)
        patient = patient_of(index) if patient_of is not None else None
        groups.append(f"patient:{patient}" if patient is not None else f"volume:{index}")
    if skipped:
        logger.warning("%s: skipped %d unusable files (first: %s)", where, len(skipped), skipped[0])
    if not indices:
        raise UserError(f"{where}: no usable volume among {counted(len(dataset), 'file')}")
    labels = np.asarray([int(m.any()) for m in masks], dtype=np.int64)
    known = any(g.startswith("patient:") for g in groups)
    return MaskedVolumes(indices, labels, domains, sources, volumes, masks, groups if known else None)


def _reversed_hint(source: str | None, shape: tuple[int, ...], sample: Any) -> str:
    """For a NIfTI mask whose axes come out reversed: how the file should have been written."""
    if source is not None and str(source).lower().endswith((".nii", ".nii.gz")) \
            and tuple(reversed(shape)) == tuple(np.shape(sample.volume)):
        return (" (reversed: a NIfTI mask's array is indexed (x, y, z) = (W, H, D); write "
                "mask.transpose(2, 1, 0) of a [D, H, W] array)")
    return ""


@attrs.frozen(eq=False)
class DenseInputs:
    """What a dense evaluator is built from: the training recipe's transform (volumes prepared
    as in training), its labelled train and (optional) test datasets, and the patch grid."""

    transform: Any
    train: Any
    test: Any | None
    patch_size: tuple[int, int, int]
    grid: tuple[int, int, int]


def dense_inputs(config: Any, ctx: Any, where: str, check_early: Any) -> DenseInputs:
    """:class:`DenseInputs` of an evaluator config with ``dataset`` and ``test_dataset`` tables,
    built in ``ctx`` (a :class:`~octfw.types.BuildContext` carrying the training recipe);
    ``check_early(dataset, transform, where)`` refuses a dataset without the labels before any
    volume is read. One-line UserErrors name ``where``."""
    if "transform" not in ctx.recipe:
        raise UserError(f"{where}: needs the training recipe's [transform] to prepare volumes as in "
                        "training, and the build context carries no recipe")
    if ctx.image_size is None or ctx.patch_size is None:
        raise UserError(f"{where}: needs the encoder's image_size and patch_size to place its tokens on the "
                        "volume, and the run declares none")
    transform = build_from_table("transform", ctx.recipe["transform"], ctx, f"{where}: transform")
    train = build_from_table("dataset", config.dataset, ctx, f"{where}: dataset")
    check_early(train, transform, f"{where}: dataset")
    test = None
    if config.test_dataset is not None:
        test = build_from_table("dataset", config.test_dataset, ctx, f"{where}: test_dataset")
        check_early(test, transform, f"{where}: test_dataset")
        check_patients_disjoint(train, test, where)
    patch = tuple(int(p) for p in ctx.patch_size)
    grid = tuple(int(i) // p for i, p in zip(ctx.image_size, patch))
    return DenseInputs(transform, train, test, patch, grid)  # type: ignore[arg-type]
