"""The ``layer-segmentation`` evaluator's class and its data (imports torch: loaded when built).

Every volume of a :class:`~octfw.types.LayeredDataset` is decoded and prepared once, its layer
labels brought to the same geometry by the transform's ``prepare_labels``
(:class:`~octfw.types.LabelPreparingTransform`, nearest label). The axial (H) spacing of a
prepared volume, for the boundary error in micrometres, is the volume's own ``dy``
(``Provenance.spacing``) times the source rows per prepared row, which is measured through the
same ``prepare_labels`` on a ramp (label = source row) of the volume's original shape: exact
whatever the transform does along H (resizing, resampling to a target spacing, cropping). A
dataset that gives no axial spacing (1 mm, what a DICOM header without one reads) leaves the
error in µm out; the error in rows of the prepared volume is always reported.

``octfw eval --shots k`` draws ``k`` labelled volumes: every volume carries the one class 0 in
``labels``, so :func:`octfw.evaluation.shots.sample_per_class` draws ``k`` of them.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from typing import Any, Mapping, Sequence

import attrs
import numpy as np
import torch

from octfw.display.errors import ContractError, CorruptFile, UserError
from octfw.evaluation.classification import check_patients_disjoint
from octfw.evaluation.segmentation import dense_inputs
from octfw.evaluation.features import prepare_volume, stratified_split, validation_split
from octfw.display.tables import counted
from octfw.types import BuildContext, LabelPreparingTransform, LayeredDataset, PatientDataset, Sample

__all__ = ["LayeredVolumes", "load_layered", "UNKNOWN_AXIAL_MM", "axial_spacing_um", "LayerSegmentationEvaluator"]

logger = logging.getLogger(__name__)
_RAMP_TOP = 254  # ramp labels 1 .. 255: 0 is left to a fit's padding


@attrs.define
class LayeredVolumes:
    """Usable volumes of one dataset with their prepared layer labels."""

    indices: list[int]
    labels: np.ndarray  #: int64 [N], all 0: one class, so --shots k draws k volumes
    domains: list[str]
    volumes: list[np.ndarray]  #: float32 [C, D, H, W], prepared as in training
    layers: list[np.ndarray]  #: uint8 [D, H, W], the prepared volume's geometry
    axial_um: np.ndarray  #: float64 [N], the prepared volumes' H spacing in µm (NaN: not given)
    layer_names: tuple[str, ...]
    groups: list[str] | None = None  #: one key per volume, equal for one patient's

    def __len__(self) -> int:
        return len(self.indices)

    def subset(self, positions: Sequence[int]) -> "LayeredVolumes":
        p = list(positions)
        return LayeredVolumes([self.indices[i] for i in p], self.labels[p], [self.domains[i] for i in p],
                              [self.volumes[i] for i in p], [self.layers[i] for i in p], self.axial_um[p],
                              self.layer_names, None if self.groups is None else [self.groups[i] for i in p])


#: A source axial spacing (mm) at or above which it is taken as not given: no OCT's rows are 1 mm apart,
#: and 1 mm is what octfw's DICOM reader uses for a header without spacing (``SpacingDefaulted``).
UNKNOWN_AXIAL_MM = 1.0


def axial_spacing_um(transform: Any, sample: Sample) -> float:
    """The prepared volume's H spacing in µm (see the module docstring); NaN where the dataset gives
    no axial spacing (:data:`UNKNOWN_AXIAL_MM`): the boundary error is then in rows only."""
    provenance = sample.provenance
    if not float(provenance.spacing[1]) < UNKNOWN_AXIAL_MM:
        return math.nan
    shape = tuple(int(s) for s in provenance.original_shape)
    if len(shape) != 3:
        shape = tuple(int(s) for s in np.shape(sample.volume))
    rows = shape[1]
    # Label 1 + source row (up to 254 rows: exact); taller scans scaled into 1 .. 255.
    step = 1.0 if rows <= _RAMP_TOP else _RAMP_TOP / (rows - 1)
    ramp_column = 1 + np.floor(np.arange(rows) * step)
    ramp = np.broadcast_to(ramp_column.astype(np.uint8)[None, :, None], shape)
    probe = Sample(np.broadcast_to(np.float32(0), shape), provenance)  # only its shape is read: no memory
    prepared = np.asarray(transform.prepare_labels(ramp, probe))
    column = prepared[prepared.shape[0] // 2, :, prepared.shape[2] // 2].astype(np.float64)
    inside = np.nonzero(column > 0)[0]
    if len(inside) < 2:
        return float(provenance.spacing[1]) * 1000.0 * rows / max(prepared.shape[1], 1)
    slope = np.polyfit(inside.astype(np.float64), column[inside], 1)[0]  # ramp labels per prepared row
    source_rows_per_row = slope / step
    return float(provenance.spacing[1]) * 1000.0 * float(source_rows_per_row)


def _check_layers_early(dataset: Any, transform: Any, where: str) -> tuple[str, ...]:
    """The layer names every volume shares; one-line UserErrors before anything is decoded."""
    if not isinstance(dataset, LayeredDataset):
        raise UserError(f"{where}: the dataset has no layer labels; use synthetic-oct or phantom-oct with "
                        "layers, or a manifest with layers and layer_names columns")
    if not isinstance(transform, LabelPreparingTransform):
        raise UserError(f"{where}: the training transform {type(transform).__name__} cannot bring layer labels to "
                        "its prepared volumes (it has no prepare_labels); oct-standard can")
    names = {dataset.layer_names(i) for i in range(len(dataset))}
    if None in names or any(dataset.layers_source(i) is None for i in range(len(dataset))):
        missing = next(i for i in range(len(dataset)) if dataset.layer_names(i) is None
                       or dataset.layers_source(i) is None)
        raise UserError(f"{where}: volume {missing} of {counted(len(dataset), 'volume')} has no layer labels; "
                        "every volume needs them")
    if len(names) != 1:
        raise UserError(f"{where}: the volumes name their layers differently ({len(names)} lists); one list "
                        "for the whole dataset")
    found = names.pop()
    assert found is not None
    if len(found) < 2:
        raise UserError(f"{where}: {len(found)} layer name; segmentation needs a background and a layer")
    return found


def load_layered(dataset: Any, transform: Any, *, where: str) -> LayeredVolumes:
    """Decode and prepare every volume and its layer labels once (see the module docstring)."""
    names = _check_layers_early(dataset, transform, where)
    patient_of = dataset.patient if isinstance(dataset, PatientDataset) else None
    out: dict[str, list[Any]] = {k: [] for k in ("indices", "domains", "volumes", "layers", "axial", "groups")}
    skipped, spacings = [], {}
    for index in range(len(dataset)):
        try:
            sample = dataset.load(index)
            volume = prepare_volume(transform, sample)
        except CorruptFile as bad:
            skipped.append(f"{bad.url}: {bad.reason}")
            continue
        try:
            labels = dataset.layers(index)
            if labels is None:
                raise UserError(f"{where}: {sample.provenance.source} has no layer labels")
            prepared = np.asarray(transform.prepare_labels(labels, sample), dtype=np.uint8)
        except CorruptFile as bad:  # the volume is fine: its labels must be fixed, not skipped
            raise UserError(f"{where}: {bad}") from None
        except ContractError as bad:
            raise UserError(f"{where}: {dataset.layers_source(index)}: {bad}") from None
        key = (tuple(sample.provenance.original_shape), tuple(sample.provenance.spacing))
        if key not in spacings:
            spacings[key] = axial_spacing_um(transform, sample)
        patient = patient_of(index) if patient_of is not None else None
        for name, value in (("indices", index), ("domains", sample.provenance.domain), ("volumes", volume),
                            ("layers", prepared), ("axial", spacings[key]),
                            ("groups", f"patient:{patient}" if patient is not None else f"volume:{index}")):
            out[name].append(value)
    if skipped:
        logger.warning("%s: skipped %d unusable files (first: %s)", where, len(skipped), skipped[0])
    if not out["indices"]:
        raise UserError(f"{where}: no usable volume among {counted(len(dataset), 'file')}")
    known = any(g.startswith("patient:") for g in out["groups"])
    return LayeredVolumes(out["indices"], np.zeros(len(out["indices"]), dtype=np.int64), out["domains"],
                          out["volumes"], out["layers"], np.asarray(out["axial"], dtype=np.float64), names,
                          out["groups"] if known else None)


def layer_keys(names: Sequence[str]) -> list[str]:
    """Metric-key forms of layer names: ``GCL+IPL`` -> ``gcl_ipl``."""
    return [re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or f"layer{i}" for i, name in enumerate(names)]


@attrs.frozen(eq=False)
class SegmentationEncoded:
    """What every fit reads: the network's three inputs per split, kept on the host (a volume at
    the seeds' size is 38 MB as float32: a cohort would not fit on a device), a batch of them
    moved to ``device`` at a time."""

    train: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  #: volumes, frozen taps, start tokens
    test: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    train_layers: torch.Tensor  #: int64 [N, D, H, W]
    encoder: Any  #: a snapshot of the encoder (BlockwiseEncoder), on the device
    taps: list[int]
    device: Any  #: where the encoder is and the fits run


class LayerSegmentationEvaluator:
    """Retinal layers per voxel from a light decoder on the encoder
    (:mod:`octfw.plugins.evaluators.layer_segmentation.algorithm`). A
    :class:`~octfw.types.RefittingEvaluator`: ``--shots k`` trains on ``k`` labelled volumes."""

    component = "layer-segmentation"

    def __init__(self, config: Any, train_dataset: Any, test_dataset: Any | None, transform: Any,
                 patch_size: tuple[int, int, int], grid: tuple[int, int, int]):
        self.config = config
        self.every_steps: int | None = config.every_steps
        self.train_dataset, self.test_dataset, self.transform = train_dataset, test_dataset, transform
        self.patch_size, self.grid = patch_size, grid
        self._split: tuple[LayeredVolumes, LayeredVolumes] | None = None
        self._fit_val: tuple[np.ndarray, np.ndarray] | None = None
        #: per test volume of the newest :meth:`score` (:func:`.metrics.per_volume`), for :meth:`difference`
        self.last_test_probabilities: dict[str, np.ndarray] | None = None

    @classmethod
    def from_config(cls, config: Any, ctx: BuildContext) -> "LayerSegmentationEvaluator":
        inputs = dense_inputs(config, ctx, f"evaluator {cls.component}", _check_layers_early)
        return cls(config, inputs.train, inputs.test, inputs.transform, inputs.patch_size, inputs.grid)

    @property
    def split_seed(self) -> int:
        return self.config.split_seed

    # --- data ----------------------------------------------------------------

    def split(self) -> tuple[LayeredVolumes, LayeredVolumes]:
        """(train, test): whole patients, stratified by vendor; with ``train_domains`` only those
        vendors' volumes may train and the others go to test (but for the other vendors' scans of
        a training patient, which are left out)."""
        if self._split is not None:
            return self._split
        config, where = self.config, f"evaluator {self.component}"
        if self.test_dataset is not None:  # from_config checked; an evaluator built directly is checked here
            check_patients_disjoint(self.train_dataset, self.test_dataset, where)
        volumes = load_layered(self.train_dataset, self.transform, where=f"{where}: dataset")
        test = None if self.test_dataset is None else load_layered(self.test_dataset, self.transform,
                                                                   where=f"{where}: test_dataset")
        if test is not None and test.layer_names != volumes.layer_names:
            raise UserError(f"{where}: test_dataset names its layers {list(test.layer_names)}, dataset "
                            f"{list(volumes.layer_names)}")
        inside = np.arange(len(volumes))
        if config.train_domains is not None:
            present = sorted(set(volumes.domains) | set(() if test is None else test.domains))
            unknown = [d for d in config.train_domains if d not in set(volumes.domains)]
            if unknown:
                raise UserError(f"{where}: train_domains {unknown} not among the dataset's vendors {present}")
            inside = np.asarray([i for i, d in enumerate(volumes.domains) if d in config.train_domains], dtype=np.int64)
        if test is None:
            candidates = volumes.subset(inside)
            train_pos, test_pos = stratified_split(candidates.labels, candidates.domains, config.train_fraction,
                                                   config.split_seed, groups=candidates.groups)
            train = candidates.subset(train_pos)
            # Another vendor's scan of a patient whose volumes train is left out: it would be tested
            # on the anatomy the decoder was trained on.
            seen = set(train.groups or ())
            outside = [p for p in np.setdiff1d(np.arange(len(volumes)), inside)
                       if volumes.groups is None or volumes.groups[p] not in seen]
            test = volumes.subset([int(inside[p]) for p in test_pos] + [int(p) for p in outside])
        else:
            train = volumes.subset(inside)
        if config.train_domains is not None and not any(d not in config.train_domains for d in test.domains):
            raise UserError(f"{where}: train_domains {config.train_domains} leaves no other vendor to test across; "
                            f"the vendors are {sorted(set(volumes.domains) | set(test.domains))}")
        if len(test) == 0 or len(train) < 2:
            raise UserError(f"{where}: {counted(len(train), 'train volume')} and {counted(len(test), 'test volume')}; "
                            "use more volumes or a test_dataset")
        self._split = (train, test)
        return self._split

    def fit_val_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(fit positions, validation positions) in the train split; drawn once, seeded, whole patients."""
        if self._fit_val is None:
            self._fit_val = validation_split(self.split()[0], self.config.val_fraction, self.config.split_seed,
                                             self.component)
        return self._fit_val

    def fit_positions(self) -> np.ndarray:
        return self.fit_val_positions()[0]

    # --- evaluation --------------------------------------------------------

    def _start(self, depth: int) -> int:
        from octfw.evaluation.fine_tuning import first_trained_block

        blocks = self.config.blocks
        return depth if blocks == 0 else first_trained_block(depth, blocks)

    def encode(self, model: Any, device: Any) -> SegmentationEncoded:
        """The frozen part run once over both splits (:func:`.algorithm.frozen_part`), and a
        snapshot of the encoder for the part that trains."""
        from octfw.evaluation.fine_tuning import encoder_to_fine_tune
        from octfw.plugins.evaluators.layer_segmentation.algorithm import frozen_part, tap_depths

        where = f"evaluator {self.component}"
        encoder = encoder_to_fine_tune(model, where)
        depth, blocks = len(encoder.blocks), self.config.blocks
        if blocks != "all" and blocks > depth:
            raise UserError(f"{where}: blocks = {blocks}, but the encoder has {depth} blocks; give 0 to {depth}, "
                            "or 'all'")
        # A snapshot: the caller's encoder may train on (the engine) or leave the device (octfw eval).
        encoder = copy.deepcopy(encoder).to(device).eval()
        taps = tap_depths(depth, self.config.taps if self.config.decoder == "unetr" else 1)
        start = self._start(depth)
        train, test = self.split()
        splits = []
        for volumes in (train, test):
            stacked = torch.from_numpy(np.stack(volumes.volumes))  # on the host: a batch at a time to the device
            frozen, tokens = [], []
            with torch.no_grad():
                for at in range(0, len(volumes), self.config.batch_size):
                    batch = stacked[at:at + self.config.batch_size].to(device)
                    read, entering = frozen_part(encoder, start, taps, batch)
                    frozen.append(read.cpu())
                    tokens.append(entering.cpu())
            splits.append((stacked, torch.cat(frozen), torch.cat(tokens)))
        if splits[0][2].shape[1] != math.prod(self.grid):
            raise UserError(f"{where}: the encoder gives {splits[0][2].shape[1]} tokens per volume; the decoder "
                            f"needs one per patch of the {'x'.join(map(str, self.grid))} grid")
        layers = torch.from_numpy(np.stack(train.layers).astype(np.int64))
        return SegmentationEncoded(splits[0], splits[1], layers, encoder, taps, device)

    def score(self, encoded: SegmentationEncoded, positions: np.ndarray | None = None) -> dict[str, float]:
        """Train on the train volumes at ``positions`` (default :meth:`fit_positions`), measure on the
        test split (see :func:`.metrics.segmentation_metrics`); with ``train_domains``, the same
        again prefixed ``in_vendor_`` and ``cross_vendor_``."""
        from octfw.plugins.evaluators.layer_segmentation.algorithm import build_decoder, fit_segmentation
        from octfw.plugins.evaluators.layer_segmentation.metrics import per_volume, volume_metrics

        config = self.config
        train, test = self.split()
        positions = self.fit_positions() if positions is None else np.asarray(positions, dtype=np.int64)
        val = self.fit_val_positions()[1]
        device = encoded.device
        fit_index, val_index = (torch.from_numpy(p) for p in (positions, val))
        encoder = encoded.encoder
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            decoder = build_decoder(config.decoder, int(encoder.embed_dim), len(encoded.taps), len(train.layer_names),
                                    self.patch_size, self.grid, int(encoded.train[0].shape[1]), config.decoder_width)
        sync = _xla_sync if torch.device(device).type == "xla" else None
        result = fit_segmentation(
            decoder, encoder, [x[fit_index] for x in encoded.train], encoded.train_layers[fit_index],
            [x[val_index] for x in encoded.train], encoded.train_layers[val_index], encoded.test,
            blocks=config.blocks, taps=encoded.taps, epochs=config.epochs, min_steps=config.min_steps,
            validations=config.validations, batch_size=config.fit_batch_size,
            lr=config.lr, layer_decay=config.layer_decay, weight_decay=config.weight_decay, seed=config.seed,
            eval_batch_size=config.batch_size, sync=sync, device=device)
        predicted, truth = result.predictions.numpy(), np.stack(test.layers)
        keys = layer_keys(train.layer_names)
        # Per test volume, kept for the paired difference from another network (octfw eval).
        self.last_test_probabilities = per_volume(predicted, truth, len(keys), test.axial_um)
        out: dict[str, float] = {}
        for prefix, keep in self._test_subsets():
            out.update(volume_metrics(
                {k: v[keep] for k, v in self.last_test_probabilities.items()}, keys,
                [test.domains[i] for i in keep], prefix=prefix,
                groups=None if test.groups is None else [test.groups[i] for i in keep],
                bootstrap=config.bootstrap, seed=config.split_seed))
        out["selected_step"] = float(result.selected_step)
        out["steps"] = float(result.steps)
        out["val_mean_dice"] = result.val_mean_dice
        out["trained_parameters"] = float(result.trained_parameters)
        out["labelled_volumes"] = float(len(positions))
        out["validation_volumes"] = float(len(val))  # labelled too: they chose selected_step
        return out

    def _test_subsets(self) -> list[tuple[str, np.ndarray]]:
        """(metric prefix, test positions): the whole test split; with ``train_domains``, also its
        training vendors' volumes (``in_vendor_``) and the others' (``cross_vendor_``), when any."""
        test = self.split()[1]
        subsets = [("", np.arange(len(test)))]
        if self.config.train_domains is not None:
            mine = np.asarray([d in self.config.train_domains for d in test.domains])
            subsets += [("in_vendor_", np.nonzero(mine)[0]), ("cross_vendor_", np.nonzero(~mine)[0])]
        return [(prefix, keep) for prefix, keep in subsets if len(keep)]

    def difference(self, first: Mapping[str, np.ndarray], second: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Every metric of two networks' kept test results (``last_test_probabilities``), first minus
        second, with a paired patient-bootstrap interval (:func:`.metrics.segmentation_difference`);
        ``[F, N, ...]`` values: the mean over ``F`` paired fits."""
        from octfw.plugins.evaluators.layer_segmentation.metrics import segmentation_difference

        train, test = self.split()
        out: dict[str, float] = {}
        for prefix, keep in self._test_subsets():
            out.update(segmentation_difference(
                {k: np.asarray(v)[..., keep, :] for k, v in first.items()},
                {k: np.asarray(v)[..., keep, :] for k, v in second.items()}, layer_keys(train.layer_names),
                [test.domains[i] for i in keep], prefix=prefix,
                groups=None if test.groups is None else [test.groups[i] for i in keep],
                bootstrap=self.config.bootstrap, seed=self.config.split_seed))
        return out

    def describe_test_split(self) -> dict[str, Any]:
        """The row spacing (µm) each vendor's boundary error in µm rests on (median over its test
        volumes; None: the dataset gives none), for the report (:mod:`octfw.evaluation.reporting`)."""
        test = self.split()[1]
        spacing: dict[str, float | None] = {}
        for domain in sorted(set(test.domains)):
            values = test.axial_um[[i for i, d in enumerate(test.domains) if d == domain]]
            known = values[~np.isnan(values)]
            spacing[domain] = float(np.median(known)) if len(known) else None
        return {"row_spacing_um": spacing}

    def evaluate(self, model: Any, device: Any, update_step: int) -> dict[str, float]:
        return self.score(self.encode(model, device))


def _xla_sync() -> None:
    import torch_xla

    torch_xla.sync()  # one graph per step, not one over the whole fit
