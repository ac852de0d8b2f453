"""The base of the classification evaluators (``linear-probe``, ``knn``, ``attentive-probe``,
``fine-tune``, each a package of :mod:`octfw.plugins.evaluators`): labelled volumes ->
frozen encoder features -> a classifier -> metrics with bootstrap intervals.

A dense or segmentation evaluator is not a classification evaluator: it implements
:class:`octfw.types.Evaluator` (``every_steps``, ``evaluate``) beside these, and
:class:`octfw.types.RefittingEvaluator` for ``octfw eval --shots`` and ``--checkpoints``.

Each builds its labelled dataset(s) and the *training* transform (from the
run's recipe in ``ctx.recipe``) through the registry, so features come from
volumes prepared exactly as the encoder saw them in training. Volumes are
decoded, checked for labels and split once, at the first evaluation; labels
are checked already at build time when the dataset can tell them without
decoding (``dicom`` and ``synthetic-oct`` can), so a recipe without labels
fails before training starts rather than after it.

An evaluation is two steps: :meth:`ClassificationEvaluator.encode` runs the frozen
encoder over both splits once, :meth:`ClassificationEvaluator.score` fits the
classifier on (a subset of) the train split and measures it on the test
split. ``octfw eval --shots`` scores one encoding many times. Fine-tuning
fits the same way: its encoding is the network's inputs (volumes, or the
tokens of the frozen blocks) and a copy of the encoder, which each fit
copies again and trains.

Called by the engine under ``torch.no_grad`` with the RNG state forked; on
its own this code uses no global random generator either.
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Mapping

import attrs
import numpy as np
import torch

from octfw.display.errors import UserError
from octfw.evaluation.config import FeatureEvaluatorConfig
from octfw.evaluation.features import (
    validation_split,
    LabelledVolumes,
    extract_readings,
    load_labelled,
    stratified_split,
)
from octfw.evaluation.metrics import classification_metrics, paired_difference
from octfw.display.tables import counted
from octfw.types import BuildContext, LabelledDataset, NamingDataset, PatientDataset

logger = logging.getLogger(__name__)

__all__ = ["READING_PREFIXES", "Encoded", "ClassificationEvaluator", "PooledClassificationEvaluator",
           "ValidatedClassificationEvaluator", "build_from_table", "check_patients_disjoint"]


def build_from_table(stage: str, table: Mapping[str, Any], ctx: BuildContext, where: str) -> Any:
    """Build the ``stage`` component a ``{ name = ..., options }`` table names,
    with the command's registry (``ctx.registry``)."""
    from octfw.recipe import build_component

    if ctx.registry is None:
        raise TypeError(f"{where}: the build context carries no registry to build a {stage} with")
    return build_component(ctx.registry, stage, table, ctx, where)


def _check_labels_early(dataset: Any, where: str) -> None:
    """Refuse a dataset without labels before any volume is decoded, when it can tell."""
    if not isinstance(dataset, LabelledDataset):
        return
    labels = [dataset.label(i) for i in range(len(dataset))]
    missing = [i for i, label in enumerate(labels) if label is None]
    if missing:
        source = dataset.url(missing[0]) if isinstance(dataset, NamingDataset) else f"volume {missing[0]}"
        raise UserError(
            f"{where}: {len(missing)} of {counted(len(labels), 'volume')} have no label (first: {source}); use a "
            "manifest with a label column, or labels = true for synthetic-oct"
        )
    if len(set(labels)) < 2:
        raise UserError(f"{where}: every volume has label {labels[0]}; a classifier needs two classes or more")


def check_patients_disjoint(train: Any, test: Any, where: str, shown: int = 3) -> None:
    """Refuse a test dataset that shares a patient with the train dataset (before decoding), in
    one line naming ``dataset`` and ``test_dataset``, how many patients and volumes they share,
    and a file of each side for the first ``shown`` shared patients.

    The message names files, never the patient key: it may be an identifier.
    """
    if not (isinstance(train, PatientDataset) and isinstance(test, PatientDataset)):
        return
    train_files: dict[str, int] = {}
    for index in range(len(train)):
        patient = train.patient(index)
        if patient is not None:
            train_files.setdefault(patient, index)
    shared: dict[str, list[int]] = {}
    for index in range(len(test)):
        patient = test.patient(index)
        if patient is not None and patient in train_files:
            shared.setdefault(patient, []).append(index)
    if shared:
        name = (lambda ds, i: ds.url(i) if isinstance(ds, NamingDataset) else f"volume {i}")
        pairs = [f"{name(test, tested[0])} and {name(train, train_files[p])}"
                 for p, tested in list(shared.items())[:shown]]
        volumes = sum(len(tested) for tested in shared.values())
        raise UserError(
            f"{where}: test_dataset shares {counted(len(shared), 'patient')} with dataset: {volumes} test volumes "
            f"belong to patients of the train dataset (first: {'; '.join(pairs)}); keep each patient on one side"
        )


@attrs.frozen(eq=False)
class Encoded:
    """What the classifier is fitted on, for both splits, on the device it is fitted on."""

    #: [N_train, E] pooled features, [N_train, T, E] tokens, or the inputs of a network to fine-tune
    train: torch.Tensor
    test: torch.Tensor
    #: the network a fine-tuning evaluator trains further: a copy made at encoding, never the
    #: caller's module; None for frozen features
    network: torch.nn.Module | None = None


class ClassificationEvaluator(abc.ABC):
    """Labelled volumes -> frozen encoder features -> a classifier -> metrics (a
    :class:`~octfw.types.RefittingEvaluator`: ``--shots`` and ``--checkpoints`` refit it).

    Subclasses implement :meth:`encode` and :meth:`fit_and_predict`.
    ``evaluate`` returns ``accuracy``, ``balanced_accuracy``, ``auroc`` and
    ``auprc`` (with bootstrap 95 % intervals ``auroc_ci_low`` /
    ``auroc_ci_high``, ...), each also per domain (``accuracy/<domain>``),
    measured on the test split.
    """

    component = "classification evaluator"

    def __init__(self, config: FeatureEvaluatorConfig, train_dataset: Any, test_dataset: Any | None,
                 transform: Any, grid: tuple[int, int, int] | None = None):
        self.config = config
        self.every_steps: int | None = config.every_steps
        self.train_dataset, self.test_dataset, self.transform = train_dataset, test_dataset, transform
        self.grid = grid  #: the encoder's patch grid (D, H, W), when the run knows it
        self._split: tuple[LabelledVolumes, LabelledVolumes] | None = None
        #: ``{metric prefix: [N_test, K]}`` probabilities of the newest :meth:`score`, for :meth:`difference`
        self.last_test_probabilities: dict[str, np.ndarray] | None = None

    @classmethod
    def from_config(cls, config: FeatureEvaluatorConfig, ctx: BuildContext):
        where = f"evaluator {cls.component}"
        if "transform" not in ctx.recipe:
            raise UserError(f"{where}: needs the training recipe's [transform] to prepare volumes as in "
                            "training, and the build context carries no recipe")
        transform = build_from_table("transform", ctx.recipe["transform"], ctx, f"{where}: transform")
        train = build_from_table("dataset", config.dataset, ctx, f"{where}: dataset")
        _check_labels_early(train, f"{where}: dataset")
        test = None
        if config.test_dataset is not None:
            test = build_from_table("dataset", config.test_dataset, ctx, f"{where}: test_dataset")
            _check_labels_early(test, f"{where}: test_dataset")
            check_patients_disjoint(train, test, where)
        grid = None
        if ctx.image_size is not None and ctx.patch_size is not None:
            grid = tuple(int(i) // int(p) for i, p in zip(ctx.image_size, ctx.patch_size))
        return cls(config, train, test, transform, grid)

    @property
    def split_seed(self) -> int:
        """Seeds the split and the draws of ``octfw eval --shots`` (:class:`octfw.types.RefittingEvaluator`)."""
        return self.config.split_seed

    # --- data ----------------------------------------------------------------

    def split(self) -> tuple[LabelledVolumes, LabelledVolumes]:
        """(train, test) volumes; decoded, prepared and split at the first call only."""
        if self._split is not None:
            return self._split
        where = f"evaluator {self.component}"
        keep = self.config.keep_volumes
        volumes = load_labelled(self.train_dataset, self.transform, keep=keep, where=f"{where}: dataset")
        if self.test_dataset is None:
            train_pos, test_pos = stratified_split(volumes.labels, volumes.domains, self.config.train_fraction,
                                                   self.config.split_seed, groups=volumes.groups)
            train, test = volumes.subset(train_pos), volumes.subset(test_pos)
        else:
            train = volumes
            test = load_labelled(self.test_dataset, self.transform, keep=keep, where=f"{where}: test_dataset")
        if len(np.unique(train.labels)) < 2:
            raise UserError(f"{where}: the train split holds one class only ({train.labels[0]}); "
                            "a classifier needs two or more")
        if len(test) == 0:
            raise UserError(f"{where}: the test split is empty; use more volumes or a test_dataset")
        _warn_if_small(test.labels, where)
        self._split = (train, test)
        return self._split

    def fit_positions(self) -> np.ndarray:
        """Positions in the train split a classifier may be fitted on (all of them here)."""
        return np.arange(len(self.split()[0]))

    # --- evaluation --------------------------------------------------------

    @abc.abstractmethod
    def encode(self, model: Any, device: Any) -> Encoded:
        """Frozen features of both splits, on the device the classifier is fitted on."""

    @abc.abstractmethod
    def fit_and_predict(self, encoded: Encoded, positions: np.ndarray,
                        classes: np.ndarray) -> tuple[torch.Tensor | Mapping[str, torch.Tensor], dict[str, float]]:
        """Fit on the train volumes at ``positions``; ``([N_test, len(classes)]`` test
        probabilities, extra host floats to report). An evaluator with several readings returns
        ``{metric prefix: probabilities}`` instead (:data:`READING_PREFIXES`)."""

    def score(self, encoded: Encoded, positions: np.ndarray | None = None) -> dict[str, float]:
        """Fit on the train volumes at ``positions`` (default :meth:`fit_positions`), measure on test."""
        train, test = self.split()
        positions = self.fit_positions() if positions is None else np.asarray(positions, dtype=np.int64)
        classes = np.unique(train.labels)  # all of them, even when a subset lacks one: columns stay fixed
        probabilities, extra = self.fit_and_predict(encoded, positions, classes)
        readings = probabilities if isinstance(probabilities, Mapping) else {"": probabilities}
        self.last_test_probabilities = {prefix: p.cpu().numpy() for prefix, p in readings.items()}
        metrics: dict[str, float] = {}
        for prefix, reading in self.last_test_probabilities.items():
            scores = classification_metrics(test.labels, reading, classes, test.domains, groups=test.groups,
                                            bootstrap=self.config.bootstrap, seed=self.config.split_seed)
            metrics.update({prefix + key: value for key, value in scores.items()})
        return {**metrics, **extra}

    def difference(self, first: Mapping[str, np.ndarray], second: Mapping[str, np.ndarray]) -> dict[str, float]:
        """AUROC and AUPRC of two models' test probabilities (``last_test_probabilities`` of
        two evaluations), first minus second, with a paired bootstrap interval; each reading's
        keys carry its metric prefix."""
        train, test = self.split()
        out: dict[str, float] = {}
        for prefix in first:
            scores = paired_difference(test.labels, first[prefix], second[prefix], np.unique(train.labels),
                                       groups=test.groups, bootstrap=self.config.bootstrap,
                                       seed=self.config.split_seed)
            out.update({prefix + key: value for key, value in scores.items()})
        return out

    def evaluate(self, model: Any, device: Any, update_step: int) -> dict[str, float]:
        return self.score(self.encode(model, device))

    def _train_part(self, encoded: Encoded, positions: np.ndarray,
                    classes: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, class indices) of the train volumes at ``positions``, on the features' device."""
        train = self.split()[0]
        device = encoded.train.device
        targets = torch.from_numpy(np.searchsorted(classes, train.labels[positions])).to(device)
        return encoded.train[torch.from_numpy(positions).to(device)], targets


#: Below this many test volumes of a class, a metric's interval spans most of [0, 1].
SMALL_TEST_CLASS = 15


def _warn_if_small(labels: np.ndarray, where: str) -> None:
    classes, counts = np.unique(labels, return_counts=True)
    if counts.min() < SMALL_TEST_CLASS:
        held = ", ".join(f"{counted(int(n), 'volume')} of class {c}" for c, n in zip(classes, counts))
        logger.warning("%s: the test split holds %s; with fewer than %d of a class its intervals are too wide "
                       "to tell encoders apart (give a larger test_dataset or more volumes)",
                       where, held, SMALL_TEST_CLASS)


#: The metric prefix of each reading of a :class:`PooledClassificationEvaluator`: the mean keeps
#: the names the evaluators always reported (``auroc``), the tokens are ``tokens_auroc``.
READING_PREFIXES = {"mean": "", "tokens": "tokens_"}


class PooledClassificationEvaluator(ClassificationEvaluator):
    """A classifier on frozen features, read as the mean over a volume's tokens (``[N, E]``), as
    its pooled tokens (``[N, T, E]``, at most ``max_tokens``), or both (the config's ``reading``),
    each fitted on its own; subclasses implement :meth:`classify`.

    One encoder pass gives both: the encoding is ``[N, 1 + T, E]``, the mean over every token of
    the encoder first, then the tokens pooled over the patch grid (none for ``reading = "mean"``).
    """

    @abc.abstractmethod
    def classify(self, train_features: torch.Tensor, train_targets: torch.Tensor,
                 test_features: torch.Tensor, n_classes: int, reading: str) -> torch.Tensor:
        """``[M, n_classes]`` class probabilities of the test features (``[N, E]`` for the reading
        ``"mean"``, ``[N, T, E]`` for ``"tokens"``)."""

    def readings(self) -> tuple[str, ...]:
        return ("mean", "tokens") if self.config.reading == "both" else (self.config.reading,)

    def encode(self, model: Any, device: Any) -> Encoded:
        train, test = self.split()
        options = dict(grid=self.grid, max_tokens=self.config.max_tokens, tokens="tokens" in self.readings(),
                       where=f"evaluator {self.component}: reading = {self.config.reading!r}")
        train_features = extract_readings(model, train, device, self.config.batch_size, **options)
        test_features = extract_readings(model, test, device, self.config.batch_size, **options)
        # The classifier is a small problem with a data-dependent loop (line search, sort);
        # on XLA each iteration would cut a graph, so it runs on the host there. On cpu and
        # cuda it runs where the features are.
        fit_device = torch.device("cpu") if torch.device(device).type == "xla" else train_features.device
        return Encoded(train_features.to(fit_device), test_features.to(fit_device))

    def fit_and_predict(self, encoded, positions, classes):
        features, targets = self._train_part(encoded, positions, classes)
        parts = {"mean": lambda x: x[:, 0], "tokens": lambda x: x[:, 1:]}
        return {READING_PREFIXES[reading]: self.classify(parts[reading](features), targets,
                                                         parts[reading](encoded.test), len(classes), reading)
                for reading in self.readings()}, {}


class ValidatedClassificationEvaluator(ClassificationEvaluator):
    """A feature evaluator that chooses (a grid member, an epoch) on a validation split.

    The validation split is carved out of the train split (the config's
    ``val_fraction`` of each domain and label, whole patients when the
    dataset knows them) and stays whole at every shot count; the classifier
    is fitted on the rest (:meth:`fit_positions`).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fit_val: tuple[np.ndarray, np.ndarray] | None = None

    def fit_val_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(fit positions, validation positions) in the train split; drawn once, seeded."""
        if self._fit_val is None:
            self._fit_val = validation_split(self.split()[0], self.config.val_fraction, self.config.split_seed,
                                             self.component)
        return self._fit_val

    def fit_positions(self) -> np.ndarray:
        return self.fit_val_positions()[0]

    def _warn_single_class(self, who: str, volumes: int) -> None:
        """Say that the choice on validation had only one-class candidates (``single_class`` = 1)."""
        logger.warning("evaluator %s: %s predicts one class for all %s; its metrics are those of a "
                       "classifier that learned nothing (reported as single_class = 1)",
                       self.component, who, counted(volumes, "validation volume"))
