"""Labelled volumes, prepared as in training, and their frozen-encoder features.

A volume is prepared exactly as the training transform prepares it before
augmentation and masking: the transform's deterministic ``prepare(sample)``
when it has one (``oct-standard`` does), else the ``target`` view of one call
with a fixed generator. The encoder then sees the whole volume, unmasked.

Features come in two forms: mean-pooled ``[N, E]`` or patch tokens
``[N, T, E]`` (the attentive probe; the linear probe's and kNN's token
readings, beside their mean in one pass), average-pooled over the patch
grid to at most ``max_tokens`` and stored in a narrow dtype, because the
full token set of a real volume is large (a 128 x 256 x 256 volume in
4 x 16 x 16 patches is 8,192 tokens: 6 MiB per volume in bfloat16 at
E = 384).

A dataset that knows each volume's patient (``dataset.patient(index)``, from
a manifest's ``patient`` column) makes the split keep each patient's volumes
on one side. The key stays in memory: it is never logged or written.

Nothing here touches a global random generator: the split draws from its
own seeded generator, and feature extraction is deterministic.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterator, Sequence

import attrs
import numpy as np
import torch

from octfw.engine.collate import float_views, view_keys
from octfw.display.errors import CorruptFile, UserError
from octfw.types import Dataset, EmbeddingModel, PatientDataset, PreparingTransform, Sample
from octfw.display.tables import counted

__all__ = ["validation_split", "prepare_volume", "LabelledVolumes", "load_labelled", "stratified_split", "extract_features",
           "pooled_grid", "pool_tokens", "extract_tokens", "extract_readings", "map_volumes"]

logger = logging.getLogger(__name__)


def prepare_volume(transform: Any, sample: Sample) -> np.ndarray:
    """``[C, D, H, W]`` float32: the unaugmented, unmasked model input for ``sample``."""
    if isinstance(transform, PreparingTransform):
        volume = np.asarray(transform.prepare(sample), dtype=np.float32)
    else:
        views = float_views(transform(sample, np.random.default_rng(0)),  # a uint8 view means b / 255
                            view_keys(transform.batch_spec()))
        volume = np.asarray(views["target"], dtype=np.float32)
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
    #: one key per volume, equal for the volumes of one patient; None: the dataset knows no patients
    groups: list[str] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def subset(self, positions: Sequence[int]) -> "LabelledVolumes":
        positions = list(positions)
        return LabelledVolumes(
            self.dataset, self.transform, [self.indices[p] for p in positions], self.labels[positions],
            [self.domains[p] for p in positions], [self.sources[p] for p in positions],
            None if self.prepared is None else [self.prepared[p] for p in positions],
            None if self.groups is None else [self.groups[p] for p in positions],
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
    when a volume has no label or no volume is usable. A volume without a
    patient, in a dataset that knows some, is a group of its own.
    """
    indices, labels, domains, sources, prepared, skipped = [], [], [], [], [], []
    patient_of: Callable[[int], str | None] | None = dataset.patient if isinstance(dataset, PatientDataset) else None
    groups: list[str] = []
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
        patient = patient_of(index) if patient_of is not None else None
        groups.append(f"patient:{patient}" if patient is not None else f"volume:{index}")
        if keep:
            prepared.append(volume)
    if skipped:
        logger.warning("%s: skipped %d unusable files (first: %s)", where, len(skipped), skipped[0])
    if not indices:
        raise UserError(f"{where}: no usable labelled volume among {counted(len(dataset), 'file')}")
    known = patient_of is not None and any(g.startswith("patient:") for g in groups)
    return LabelledVolumes(dataset, transform, indices, np.asarray(labels, dtype=np.int64), domains, sources,
                           prepared if keep else None, groups if known else None)


def stratified_split(
    labels: np.ndarray, domains: Sequence[str], train_fraction: float, seed: int | Sequence[int],
    groups: Sequence[str] | None = None,
) -> tuple[list[int], list[int]]:
    """(train positions, test positions), stratified by (domain, label).

    Each stratum puts ``round(train_fraction x n)`` of its ``n`` volumes in
    train, at least one on each side when ``n >= 2`` (a single volume goes to
    train). The draw uses its own generator seeded with ``seed``.

    With ``groups`` (one key per volume, e.g. its patient) whole groups are
    assigned instead of volumes: a group's stratum is the set of its domains
    and the set of its labels, and the rule above counts groups. Groups of
    one volume each give exactly the volume split.
    """
    rng = np.random.default_rng(seed)
    keys = list(range(len(labels))) if groups is None else list(groups)
    members: dict[Any, list[int]] = {}
    for position, key in enumerate(keys):
        members.setdefault(key, []).append(position)
    order = list(members)  # groups in order of first appearance
    strata: dict[tuple[tuple[str, ...], tuple[int, ...]], list[int]] = {}
    for number, key in enumerate(order):
        positions = members[key]
        stratum = (tuple(sorted({domains[p] for p in positions})),
                   tuple(sorted({int(labels[p]) for p in positions})))
        strata.setdefault(stratum, []).append(number)
    train, test = [], []
    for stratum in sorted(strata):
        drawn = np.asarray(strata[stratum])[rng.permutation(len(strata[stratum]))].tolist()
        n = len(drawn)
        n_train = n if n == 1 else min(max(int(round(train_fraction * n)), 1), n - 1)
        train += [p for number in drawn[:n_train] for p in members[order[number]]]
        test += [p for number in drawn[n_train:] for p in members[order[number]]]
    return sorted(train), sorted(test)


def _tokens(model: Any, volumes: torch.Tensor) -> torch.Tensor:
    """``model.embed`` (target encoder tokens) or ``model(volumes)``: ``[B, N, E]`` or ``[B, E]``."""
    encode = model.embed if isinstance(model, EmbeddingModel) else model
    return encode(volumes)


def _mean_pooled(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.float().mean(dim=1) if tokens.ndim == 3 else tokens.float()


def _extract(model: Any, volumes: LabelledVolumes, device: Any, batch_size: int,
             reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``reduce(encoder output)`` of every volume, batch by batch, concatenated on ``device``.

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
                    chunks.append(reduce(_tokens(model, torch.from_numpy(np.stack(batch)).to(device))))
                    batch = []
            if batch:
                real = len(batch)
                batch += [batch[-1]] * (batch_size - real)
                chunks.append(reduce(_tokens(model, torch.from_numpy(np.stack(batch)).to(device)))[:real])
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return torch.cat(chunks)


def map_volumes(function: Callable[[torch.Tensor], torch.Tensor], volumes: LabelledVolumes, device: Any,
                batch_size: int) -> torch.Tensor:
    """``function(batch)`` of every volume (``[B, C, D, H, W]`` on ``device`` in, ``[B, ...]`` out),
    batched as features are, under ``torch.no_grad``, concatenated on ``device`` as float32."""
    return _extract(function, volumes, device, batch_size, lambda out: out.float())


def extract_features(model: Any, volumes: LabelledVolumes, device: Any, batch_size: int) -> torch.Tensor:
    """Mean-pooled frozen-encoder features ``[N, E]`` (float32) on ``device``, in batches."""
    return _extract(model, volumes, device, batch_size, _mean_pooled)


def pooled_grid(grid: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """The patch grid, its longest side halved (rounded up) until at most ``max_tokens`` cells remain.

    Halving the longest side keeps the cells close to the patches' own shape;
    ``(32, 16, 16)`` with 64 tokens becomes ``(4, 4, 4)``. A grid already small
    enough is kept.
    """
    cells = [int(g) for g in grid]
    while math.prod(cells) > max_tokens and max(cells) > 1:
        longest = cells.index(max(cells))
        cells[longest] = -(-cells[longest] // 2)
    return tuple(cells)


def pool_tokens(tokens: torch.Tensor, grid: Sequence[int] | None, max_tokens: int) -> torch.Tensor:
    """``[B, N, E]`` patch tokens -> ``[B, T, E]`` float32 with ``T <= max_tokens``.

    With the patch ``grid`` (row-major, as the encoder orders its tokens) the
    tokens are average-pooled over 3-D cells of :func:`pooled_grid`, so a
    pooled token still covers one region of the volume; without it (or when
    the count does not match) over runs of consecutive tokens.
    """
    tokens = tokens.float()
    count, width = tokens.shape[1], tokens.shape[2]
    if count <= max_tokens:
        return tokens
    if grid is not None and math.prod(grid) == count:
        cells = pooled_grid(grid, max_tokens)
        volume = tokens.transpose(1, 2).reshape(tokens.shape[0], width, *grid)
        pooled = torch.nn.functional.adaptive_avg_pool3d(volume, cells)
        return pooled.reshape(tokens.shape[0], width, -1).transpose(1, 2)
    pooled = torch.nn.functional.adaptive_avg_pool1d(tokens.transpose(1, 2), max_tokens)
    return pooled.transpose(1, 2)


def extract_tokens(model: Any, volumes: LabelledVolumes, device: Any, batch_size: int, *,
                   grid: Sequence[int] | None, max_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Frozen patch tokens ``[N, T, E]`` on ``device`` in ``dtype``, ``T <= max_tokens``.

    Pooled and narrowed batch by batch, so the full token set of only one
    batch exists at a time; the cache is ``N x T x E`` elements of ``dtype``.
    """
    def reduce(tokens: torch.Tensor) -> torch.Tensor:
        return pool_tokens(_token_batch(tokens, "an attentive probe"), grid, max_tokens).to(dtype)

    return _extract(model, volumes, device, batch_size, reduce)


def _token_batch(tokens: torch.Tensor, where: str) -> torch.Tensor:
    if tokens.ndim != 3:
        raise UserError(f"{where}: the encoder returned features of shape {list(tokens.shape)}; "
                        "reading tokens needs patch tokens [B, N, E]")
    return tokens


def extract_readings(model: Any, volumes: LabelledVolumes, device: Any, batch_size: int, *,
                     grid: Sequence[int] | None, max_tokens: int, tokens: bool, where: str) -> torch.Tensor:
    """``[N, 1 + T, E]`` float32 on ``device``: the mean over every token of a volume, then (with
    ``tokens``) its tokens pooled to ``T <= max_tokens``; ``[N, 1, E]`` without. One encoder pass
    for both readings. Raises UserError, naming ``where``, when ``tokens`` is asked of an encoder
    that returns no tokens."""
    def reduce(out: torch.Tensor) -> torch.Tensor:
        mean = _mean_pooled(out)[:, None]
        if not tokens:
            return mean
        return torch.cat([mean, pool_tokens(_token_batch(out, where), grid, max_tokens)], dim=1)

    return _extract(model, volumes, device, batch_size, reduce)


def validation_split(train: Any, val_fraction: float, split_seed: int, who: str) -> tuple[np.ndarray, np.ndarray]:
    """(fit positions, validation positions) of the train split ``train`` (its ``labels``,
    ``domains`` and patient ``groups``): ``val_fraction`` of each domain and label held out, whole
    patients, seeded; a UserError naming ``who`` when nothing is left to validate on."""
    fit, val = stratified_split(train.labels, train.domains, 1.0 - val_fraction, [split_seed, 1],
                                groups=train.groups)
    if not val:
        raise UserError(f"evaluator {who}: the validation split is empty (train split of "
                        f"{counted(len(train), 'volume')}, val_fraction {val_fraction}); use more volumes")
    return np.asarray(fit, dtype=np.int64), np.asarray(val, dtype=np.int64)
