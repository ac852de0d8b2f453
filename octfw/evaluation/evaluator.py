"""The ``linear-probe`` and ``knn`` evaluators.

Both build their labelled dataset(s) and the *training* transform (from the
run's recipe in ``ctx.recipe``) through the registry, so features come from
volumes prepared exactly as the encoder saw them in training. Volumes are
decoded, checked for labels and split once, at the first evaluation; labels
are checked already at build time when the dataset can tell them without
decoding (``dicom`` and ``synthetic-oct`` can), so a recipe without labels
fails before training starts rather than after it.

Called by the engine under ``torch.no_grad`` with the RNG state forked; on
its own this code uses no global random generator either.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping

import numpy as np
import torch

from octfw.errors import UserError
from octfw.evaluation.config import FeatureEvaluatorConfig
from octfw.evaluation.features import LabelledVolumes, extract_features, load_labelled, stratified_split
from octfw.evaluation.knn import knn_probabilities
from octfw.evaluation.metrics import classification_metrics
from octfw.evaluation.probe import fit_linear_probe
from octfw.types import BuildContext

__all__ = ["FeatureEvaluator", "LinearProbeEvaluator", "KNNEvaluator", "build_from_table"]


def build_from_table(stage: str, table: Mapping[str, Any], ctx: BuildContext, where: str) -> Any:
    """Build the ``stage`` component a ``{ name = ..., options }`` table names,
    with the command's registry (``ctx.registry``)."""
    from octfw.recipe import structure_stage

    if ctx.registry is None:
        raise TypeError(f"{where}: the build context carries no registry to build a {stage} with")
    spec, problems = structure_stage(ctx.registry, stage, table, "")
    if spec is None or problems:
        raise UserError(f"{where}: " + "; ".join(f"{path}: {message}" if path else message
                                                 for path, message in problems))
    return spec.build(ctx)


def _check_labels_early(dataset: Any, where: str) -> None:
    """Refuse a dataset without labels before any volume is decoded, when it can tell."""
    if not hasattr(dataset, "label"):
        return
    labels = [dataset.label(i) for i in range(len(dataset))]
    missing = [i for i, label in enumerate(labels) if label is None]
    if missing:
        source = dataset.url(missing[0]) if hasattr(dataset, "url") else f"volume {missing[0]}"
        raise UserError(
            f"{where}: {len(missing)} of {len(labels)} volumes have no label (first: {source}); use a "
            "manifest with a label column, or labels = true for synthetic-oct"
        )
    if len(set(labels)) < 2:
        raise UserError(f"{where}: every volume has label {labels[0]}; a classifier needs two classes or more")


class FeatureEvaluator(abc.ABC):
    """Labelled volumes -> frozen, mean-pooled features -> a classifier -> metrics.

    Subclasses implement :meth:`classify`. ``evaluate`` returns ``accuracy``,
    ``balanced_accuracy`` and, for labels 0/1, ``auroc``, each also per domain
    (``accuracy/<domain>``), measured on the test split.
    """

    component = "feature evaluator"

    def __init__(self, config: FeatureEvaluatorConfig, train_dataset: Any, test_dataset: Any | None,
                 transform: Any):
        self.config = config
        self.every_steps: int | None = config.every_steps
        self.train_dataset, self.test_dataset, self.transform = train_dataset, test_dataset, transform
        self._split: tuple[LabelledVolumes, LabelledVolumes] | None = None

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
        return cls(config, train, test, transform)

    # --- data ----------------------------------------------------------------

    def split(self) -> tuple[LabelledVolumes, LabelledVolumes]:
        """(train, test) volumes; decoded, prepared and split at the first call only."""
        if self._split is not None:
            return self._split
        where = f"evaluator {self.component}"
        keep = self.config.keep_volumes
        volumes = load_labelled(self.train_dataset, self.transform, keep=keep, where=f"{where}: dataset")
        if self.test_dataset is None:
            train_pos, test_pos = stratified_split(volumes.labels, volumes.domains,
                                                   self.config.train_fraction, self.config.split_seed)
            train, test = volumes.subset(train_pos), volumes.subset(test_pos)
        else:
            train = volumes
            test = load_labelled(self.test_dataset, self.transform, keep=keep, where=f"{where}: test_dataset")
        if len(np.unique(train.labels)) < 2:
            raise UserError(f"{where}: the train split holds one class only ({train.labels[0]}); "
                            "a classifier needs two or more")
        if len(test) == 0:
            raise UserError(f"{where}: the test split is empty; use more volumes or a test_dataset")
        self._split = (train, test)
        return self._split

    # --- evaluation --------------------------------------------------------

    @abc.abstractmethod
    def classify(self, train_features: torch.Tensor, train_targets: torch.Tensor,
                 test_features: torch.Tensor, n_classes: int) -> torch.Tensor:
        """``[M, n_classes]`` class probabilities of the test features."""

    def evaluate(self, model: Any, device: Any, update_step: int) -> dict[str, float]:
        train, test = self.split()
        batch_size = self.config.batch_size
        train_features = extract_features(model, train, device, batch_size)
        test_features = extract_features(model, test, device, batch_size)
        # The classifier is a small [N, E] problem with a data-dependent loop
        # (line search); on XLA each iteration would cut a graph, so it runs
        # on the host there. On cpu and cuda it runs where the features are.
        fit_device = torch.device("cpu") if torch.device(device).type == "xla" else train_features.device
        classes = np.unique(train.labels)
        targets = torch.from_numpy(np.searchsorted(classes, train.labels)).to(fit_device)
        probabilities = self.classify(train_features.to(fit_device), targets, test_features.to(fit_device),
                                      len(classes))
        return classification_metrics(test.labels, probabilities.cpu().numpy(), classes, test.domains)


class LinearProbeEvaluator(FeatureEvaluator):
    component = "linear-probe"

    def classify(self, train_features, train_targets, test_features, n_classes):
        probe = fit_linear_probe(train_features, train_targets, n_classes,
                                 l2=self.config.l2, max_iter=self.config.max_iter)
        return probe.probabilities(test_features)


class KNNEvaluator(FeatureEvaluator):
    component = "knn"

    def classify(self, train_features, train_targets, test_features, n_classes):
        return knn_probabilities(train_features, train_targets, test_features, n_classes,
                                 k=self.config.k, weighting=self.config.weighting,
                                 temperature=self.config.temperature)
