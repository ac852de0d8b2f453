"""Options shared by the feature evaluators, and nested component tables.

An evaluator names its labelled dataset the way a recipe names any
component, as a table inside its own: ``dataset = { name = "synthetic-oct",
labels = true }``. The table is checked against the dataset component's
config class when the recipe is validated (unknown keys, bad values), and
stored resolved: relative paths made absolute against the recipe's folder,
every default filled in, only plain data (so a checkpoint that carries the
recipe still loads with ``weights_only=True``).

Light at import: attrs and octfw's light modules only.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import choices, component_table, doc, in_range, non_negative, positive

__all__ = ["FeatureEvaluatorConfig", "TokenEvaluatorConfig", "ReadingEvaluatorConfig", "READINGS"]

#: What a frozen-feature classifier reads: the mean of the tokens, the tokens themselves, or both.
READINGS = ("mean", "tokens", "both")


@attrs.frozen
class FeatureEvaluatorConfig:
    """Options every frozen-feature evaluator (``linear-probe``, ``knn``, ``attentive-probe``) takes."""

    dataset: dict[str, Any] = component_table(
        "dataset",
        "labelled dataset, a component table: { name = \"synthetic-oct\", labels = true, seed = 1 } "
        "or { name = \"dicom\", path = \"labels.csv\" } (a manifest with a label column)",
    )
    test_dataset: dict[str, Any] | None = component_table(
        "dataset",
        "held-out labelled dataset table (e.g. the manifest with split = \"test\"); "
        "unset: `dataset` is split by train_fraction",
        default=None,
    )
    train_fraction: float = doc(
        "share of `dataset` the classifier is fitted on when test_dataset is unset; "
        "the split is stratified by domain and label, and keeps each patient's volumes on one side "
        "when the manifest has a patient column",
        default=0.5, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    split_seed: int = doc(
        "seed of the train/test split (independent of the run's seed, so runs compare on "
        "the same split)",
        default=0, validator=non_negative,
    )
    every_steps: int | None = doc(
        "evaluate every N update steps; unset: only at the end of training",
        default=None, validator=positive,
    )
    batch_size: int = doc(
        "volumes per forward pass of the encoder during feature extraction",
        default=4, validator=positive,
    )
    bootstrap: int = doc(
        "bootstrap resamples of the test split (whole patients when the manifest has a patient "
        "column) for the 95 % intervals of AUROC and AUPRC; 0: no intervals",
        default=1000, validator=non_negative,
    )
    keep_volumes: bool = doc(
        "keep the prepared volumes in host memory between evaluations (decoded once); "
        "false: decode and prepare them again at each evaluation",
        default=True,
    )


@attrs.frozen
class TokenEvaluatorConfig(FeatureEvaluatorConfig):
    """Options of an evaluator that reads patch tokens (``attentive-probe``, and the token
    readings of ``linear-probe`` and ``knn``)."""

    max_tokens: int = doc(
        "patch tokens kept per volume: the patch grid is average-pooled (longest side halved) "
        "until at most this many cells remain; bounds the cache at volumes x max_tokens x width",
        default=64, validator=positive,
    )


@attrs.frozen
class ReadingEvaluatorConfig(TokenEvaluatorConfig):
    """Options of a classifier on frozen features that can read the mean of the tokens or the
    tokens themselves (``linear-probe``, ``knn``)."""

    reading: str = doc(
        "'mean': the classifier reads the mean over a volume's tokens (metrics accuracy, auroc, ...); "
        "'tokens': the max_tokens pooled tokens, concatenated (metrics tokens_accuracy, tokens_auroc, "
        "...), which keeps a finding a few tokens see; 'both': both, fitted separately",
        default="both", validator=choices(*READINGS),
    )
