"""The ``dense-probe`` evaluator: the finding mask predicted from the encoder's patch tokens.

Config, factory and registration; the class is :mod:`.evaluator`, the algorithm :mod:`.algorithm`,
the masked volumes it reads :mod:`octfw.evaluation.segmentation`.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import choices, component_table, doc, in_range, non_negative, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Evaluator

__all__ = ["DenseProbeConfig", "build"]


@attrs.frozen
class DenseProbeConfig:
    """Linear heads on every token of the target encoder predict a finding's mask: per token (does
    the patch hold the finding) and per voxel (a linear decoder to the patch's voxels); from frozen
    tokens, and with the encoder fine-tuned. Dice and IoU on held-out volumes, with patient-level
    bootstrap intervals."""

    dataset: dict[str, Any] = component_table(
        "dataset",
        "dataset with a finding mask per volume, a component table: { name = \"phantom-oct\", "
        "family = \"held-out\" } or { name = \"dicom\", path = \"cohort.jsonl\" } (a manifest with a "
        "mask column: .npy, NIfTI or DICOM SEG files of each volume's shape)",
    )
    test_dataset: dict[str, Any] | None = component_table(
        "dataset",
        "held-out dataset table with masks (e.g. the manifest with split = \"test\"); "
        "unset: `dataset` is split by train_fraction",
        default=None,
    )
    train_fraction: float = doc(
        "share of `dataset`'s patients the heads are fitted on when test_dataset is unset; "
        "stratified by domain and by whether a volume holds the finding, whole patients on one side",
        default=0.5, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    val_fraction: float = doc(
        "share of the train split held out to choose the epoch (whole patients); the test split "
        "never chooses",
        default=0.25, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    split_seed: int = doc(
        "seed of the splits and of the bootstrap (independent of the run's seed, so runs compare on "
        "the same split)",
        default=0, validator=non_negative,
    )
    every_steps: int | None = doc(
        "evaluate every N update steps; unset: only at the end of training",
        default=None, validator=positive,
    )
    batch_size: int = doc(
        "volumes per forward pass of the encoder when encoding and predicting",
        default=4, validator=positive,
    )
    bootstrap: int = doc(
        "bootstrap resamples of the test split's patients for the 95 % intervals of Dice and IoU; "
        "0: no intervals",
        default=1000, validator=non_negative,
    )
    token_target: str = doc(
        "when a token counts as in the finding: 'any' voxel of its patch is, or the 'majority' "
        "of them (for findings larger than a patch)",
        default="any", validator=choices("any", "majority"),
    )
    epochs: int = doc(
        "passes over the fit volumes for the heads on frozen tokens; the validation split is "
        "scored after each",
        default=40, validator=positive,
    )
    lr: float = doc(
        "peak AdamW learning rate of the heads on frozen tokens (10 % warmup, then cosine to 0)",
        default=1e-2, validator=positive,
    )
    fine_tune_epochs: int = doc(
        "passes over the fit volumes with the encoder trained under the heads; 0: frozen tokens only",
        default=10, validator=non_negative,
    )
    fine_tune_lr: float = doc(
        "peak AdamW learning rate of the heads and final norm when fine-tuning; block i of depth L "
        "gets fine_tune_lr x layer_decay ^ (L - i), the patch embedding ... ^ (L + 1)",
        default=1e-3, validator=positive,
    )
    layer_decay: float = doc(
        "layer-wise learning-rate decay in (0, 1] when fine-tuning: 1 trains every layer at fine_tune_lr",
        default=0.75, validator=in_range(0.0, 1.0, low_open=True),
    )
    weight_decay: float = doc(
        "decoupled AdamW weight decay of the matrices when fine-tuning (none on biases and norm "
        "scales; none on frozen tokens' heads)",
        default=0.05, validator=non_negative,
    )
    fit_batch_size: int = doc(
        "volumes per update step (capped at the fit volumes; every step is full, so an XLA graph "
        "compiles once)",
        default=8, validator=positive,
    )
    seed: int = doc(
        "seed of the mini-batch order (the heads start at zero weights and the prior's log-odds)",
        default=0, validator=non_negative,
    )


def build(config: DenseProbeConfig, ctx: BuildContext) -> Evaluator:
    from octfw.plugins.evaluators.dense_probe.evaluator import DenseProbeEvaluator

    return DenseProbeEvaluator.from_config(config, ctx)


@hookimpl
def octfw_register_evaluators(register: Register) -> None:
    register(
        "dense-probe",
        DenseProbeConfig,
        build,
        "A finding's mask predicted from the encoder's tokens, per token and per voxel (a linear "
        "decoder), frozen and fine-tuned; Dice and IoU with patient-level bootstrap intervals.",
    )
