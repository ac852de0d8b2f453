"""Labelled volumes, prepared as in training, and their frozen-encoder features.

A volume is prepared exactly as the training transform prepares it before
augmentation and masking: the transform's deterministic ``prepare(sample)``
when it has one (``oct-standard`` does), else the ``target`` view of one call
with a fixed generator. The encoder then sees the whole volume, unmasked.

Nothing here touches a global random generator: the split draws from its
own seeded generator, and feature extraction is deterministic.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import attrs
import numpy as np
import torch

from octfw.errors import CorruptFile, UserError
from octfw.types import Dataset, Sample

__all__ = ["prepare_volume", "LabelledVolumes", "load_labelled", "stratified_split", "extract_features"]

logger = logging.getLogger(__name__)


def prepare_volume(transform: Any, sample: Sample) -> np.ndarray:
    """``[C, D, H, W]`` float32: the unaugmented, unmasked model input for ``sample``."""
    if hasattr(transform, "prepare"):
        volume = np.asarray(transform.prepare(sample), dtype=np.float32)
    else:
        volume = np.asarray(transform(sample, np.random.default_rng(0))["target"], dtype=np.float32)
    return volume[None] if volume.ndim == 3 else volume


@attrs.define
class LabelledVolumes:
    """Usable labelled volumes of one dataset: labels, domains and (kept) prepared arrays."""

    dataset: Dataset
    transform: Any
    indices: list[int]  #: dataset indices, in order
    labels: np.ndarray  #: int64 [N]
    domains: list[str]
    sources: list[str]
    prepared: list[np.ndarray] | None  #: None: prepared again on each pass

    def __len__(self) -> int:
        return len(self.indices)

    def subset(self, positions: Sequence[int]) -> "LabelledVolumes":
        positions = list(positions)
        return LabelledVolumes(
            self.dataset, self.transform, [self.indices[p] for p in positions], self.labels[positions],
            [self.domains[p] for p in positions], [self.sources[p] for p in positions],
            None if self.prepared is None else [self.prepared[p] for p in positions],
        )

    def arrays(self) -> Iterator[np.ndarray]:
        if self.prepared is not None:
            yield from self.prepared
            return
        for index, source in zip(self.indices, self.sources):
            try:
                yield prepare_volume(self.transform, self.dataset.load(index))
            except CorruptFile as bad:
                raise UserError(f"evaluation volume {source} became unusable: {bad.reason}") from None


def load_labelled(dataset: Dataset, transform: Any, *, keep: bool, where: str) -> LabelledVolumes:
    """Decode and prepare every volume once; skip unusable files (counted in one warning).

    Raises UserError, naming ``where`` (``evaluator linear-probe dataset``),
    when a volume has no label or no volume is usable.
    """
    indices, labels, domains, sources, prepared, skipped = [], [], [], [], [], []
    for index in range(len(dataset)):
        try:
            sample = dataset.load(index)
            volume = prepare_volume(transform, sample)
        except CorruptFile as bad:
            skipped.append(f"{bad.url}: {bad.reason}")
            continue
        if sample.provenance.label is None:
            raise UserError(
                f"{where}: {sample.provenance.source} has no label; use a manifest with a label "
                "column, or labels = true for synthetic-oct"
            )
        indices.append(index)
        labels.append(int(sample.provenance.label))
        domains.append(sample.provenance.domain)
        sources.append(sample.provenance.source)
        if keep:
            prepared.append(volume)
    if skipped:
        logger.warning("%s: skipped %d unusable files (first: %s)", where, len(skipped), skipped[0])
    if not indices:
        raise UserError(f"{where}: no usable labelled volume among {len(dataset)} files")
    return LabelledVolumes(dataset, transform, indices, np.asarray(labels, dtype=np.int64), domains, sources,
                           prepared if keep else None)


def stratified_split(
    labels: np.ndarray, domains: Sequence[str], train_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """(train positions, test positions), stratified by (domain, label).

    Each stratum puts ``round(train_fraction x n)`` of its ``n`` volumes in
    train, at least one on each side when ``n >= 2`` (a single volume goes to
    train). The draw uses its own generator seeded with ``seed``.
    """
    rng = np.random.default_rng(seed)
    strata: dict[tuple[str, int], list[int]] = {}
    for position, (domain, label) in enumerate(zip(domains, labels.tolist())):
        strata.setdefault((domain, label), []).append(position)
    train, test = [], []
    for key in sorted(strata):
        members = np.asarray(strata[key])[rng.permutation(len(strata[key]))].tolist()
        n = len(members)
        n_train = n if n == 1 else min(max(int(round(train_fraction * n)), 1), n - 1)
        train += members[:n_train]
        test += members[n_train:]
    return sorted(train), sorted(test)


def _encode(model: Any, volumes: torch.Tensor) -> torch.Tensor:
    """Pooled features ``[B, E]``: ``model.embed`` (target encoder tokens) or ``model(volumes)``."""
    encode = model.embed if hasattr(model, "embed") else model
    tokens = encode(volumes)
    return tokens.float().mean(dim=1) if tokens.ndim == 3 else tokens.float()


def extract_features(model: Any, volumes: LabelledVolumes, device: Any, batch_size: int) -> torch.Tensor:
    """Mean-pooled frozen-encoder features ``[N, E]`` on ``device``, in batches.

    Every batch has ``batch_size`` volumes (the last one padded by repeating
    its final volume, then trimmed) so an XLA graph compiles once. The
    model's train/eval mode is restored afterwards; nothing else is changed.
    """
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    chunks: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            batch: list[np.ndarray] = []
            for array in volumes.arrays():
                batch.append(array)
                if len(batch) == batch_size:
                    chunks.append(_encode(model, torch.from_numpy(np.stack(batch)).to(device)))
                    batch = []
            if batch:
                real = len(batch)
                batch += [batch[-1]] * (batch_size - real)
                chunks.append(_encode(model, torch.from_numpy(np.stack(batch)).to(device))[:real])
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return torch.cat(chunks)
