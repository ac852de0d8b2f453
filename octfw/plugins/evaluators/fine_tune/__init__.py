"""The ``fine-tune`` evaluator: the encoder trained further with a head, the field's protocol.

Config, factory and registration; the algorithm is :mod:`.algorithm`
and its class :class:`.evaluator.FineTuneEvaluator`.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.evaluation.config import FeatureEvaluatorConfig
from octfw.recipe.fields import doc, in_range, non_negative, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Evaluator

__all__ = ["FineTuneConfig", "build"]


def _blocks(instance: Any, attribute: attrs.Attribute, value: int | str) -> None:
    # bool is an int to Python; `blocks = true` is a mistake, not block 1.
    if value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ValueError(f"must be 'all' or a number of blocks >= 1, got {value!r}")


@attrs.frozen
class FineTuneConfig(FeatureEvaluatorConfig):
    """The target encoder fine-tuned with V-JEPA's attentive head on its tokens,
    AdamW with layer-wise learning-rate decay; the epoch is chosen on a validation split
    carved out of the train split, and measured on the test split."""

    blocks: int | str = doc(
        "what trains: 'all' (the whole encoder, patch embedding included) or k, the last k "
        "blocks with the final norm and the head (the frozen part runs once, its tokens cached)",
        default="all", validator=_blocks,
    )
    epochs: int = doc(
        "passes over the fit volumes; the validation split is scored after each", default=15,
        validator=positive,
    )
    fit_batch_size: int = doc(
        "volumes per update step (capped at the fit volumes; every step is full, so an XLA "
        "graph compiles once)",
        default=8, validator=positive,
    )
    lr: float = doc(
        "peak AdamW learning rate of the head and final norm (10 % linear warmup, then cosine "
        "to 0); block i of depth L gets lr x layer_decay ^ (L - i), the patch embedding "
        "lr x layer_decay ^ (L + 1)",
        default=1e-3, validator=positive,
    )
    layer_decay: float = doc(
        "layer-wise learning-rate decay in (0, 1]: 1 trains every layer at lr",
        default=0.75, validator=in_range(0.0, 1.0, low_open=True),
    )
    weight_decay: float = doc(
        "decoupled AdamW weight decay of the matrices (none on biases and norm scales)",
        default=0.05, validator=non_negative,
    )
    val_fraction: float = doc(
        "share of the train split held out to choose the epoch (stratified by domain and "
        "label, whole patients); the test split never chooses",
        default=0.25, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    num_heads: int = doc(
        "attention heads of the attentive head (as the attentive probe's); must divide the "
        "encoder's width", default=12, validator=positive,
    )
    head_epochs: int = doc(
        "passes of a first phase that trains the head alone on the starting encoder's tokens "
        "(linear probing, then fine-tuning: LP-FT); its best validation epoch starts the "
        "fine-tuning and competes with its epochs (selected_epoch 0). 0: the head starts from "
        "its initial weights",
        default=100, validator=non_negative,
    )
    head_lr: float = doc(
        "peak AdamW learning rate of the head's first phase (10 % warmup, then cosine to 0)",
        default=1e-2, validator=positive,
    )
    seed: int = doc(
        "seed of the head's initial weights and the mini-batch order", default=0, validator=non_negative,
    )


def build(config: FineTuneConfig, ctx: BuildContext) -> Evaluator:
    from octfw.plugins.evaluators.fine_tune.evaluator import FineTuneEvaluator

    return FineTuneEvaluator.from_config(config, ctx)


@hookimpl
def octfw_register_evaluators(register: Register) -> None:
    register(
        "fine-tune",
        FineTuneConfig,
        build,
        "The encoder fine-tuned (whole, or its last k blocks) with layer-wise learning-rate "
        "decay and V-JEPA's attentive head; the epoch is chosen on a validation split.",
    )
