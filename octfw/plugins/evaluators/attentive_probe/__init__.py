"""The ``attentive-probe`` evaluator: learned-query attention over frozen patch tokens.

Config, factory and registration; the algorithm is :mod:`.algorithm`
and its class :class:`.evaluator.AttentiveProbeEvaluator`.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.evaluation.config import TokenEvaluatorConfig
from octfw.recipe.fields import choices, doc, in_range, non_negative, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Evaluator

__all__ = ["AttentiveProbeConfig", "build"]

TOKEN_DTYPES = ("bfloat16", "float16", "float32")


def _grid_values(minimum: float, *, open_low: bool):
    def check(instance: Any, attribute: attrs.Attribute, value: tuple[float, ...]) -> None:
        if not value:
            raise ValueError("must list one value or more")
        bad = [v for v in value if (v <= minimum if open_low else v < minimum)]
        if bad:
            raise ValueError(f"every value must be {'>' if open_low else '>='} {minimum}, got {list(value)!r}")

    return check


@attrs.frozen
class AttentiveProbeConfig(TokenEvaluatorConfig):
    """V-JEPA's attentive probe (a learned query token, a cross-attention block, a linear
    classifier) on target-encoder patch tokens, one per learning rate x weight decay, trained
    together until the validation split stops improving; the member is chosen on that
    validation split, carved out of the train split, and measured on the test split."""

    learning_rates: tuple[float, ...] = doc(
        "peak AdamW learning rates of the grid (warmup over 10 % of max_epochs, then cosine to 0); "
        "the default spans what random and pretrained tokens need (docs/evaluation.md)",
        default=(1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3), validator=_grid_values(0.0, open_low=True),
    )
    weight_decays: tuple[float, ...] = doc(
        "decoupled weight decays of the grid (on the query and the matrices); "
        "members = learning_rates x weight_decays",
        default=(0.01, 0.1, 1.0), validator=_grid_values(0.0, open_low=False),
    )
    num_heads: int = doc(
        "attention heads of the cross-attention (V-JEPA's ViT-B count); must divide the encoder's "
        "width. On the phantom cysts, 12 heads found the finding where 1 and 4 did not",
        default=12, validator=positive,
    )
    max_epochs: int = doc(
        "most passes over the fit volumes (every member sees the same mini-batches)",
        default=500, validator=positive,
    )
    patience: int = doc(
        "stop when no member's validation balanced accuracy (or, at equal accuracy, cross-entropy) "
        "has improved for this many epochs; each member keeps its best epoch",
        default=40, validator=positive,
    )
    fit_batch_size: int = doc(
        "volumes per probe update step (capped at the fit volumes; an epoch's permutation wraps "
        "to fill its last batch, so every step is full and an XLA graph compiles once)",
        default=16, validator=positive,
    )
    val_fraction: float = doc(
        "share of the train split held out to choose the grid member (stratified by domain and "
        "label, whole patients); the test split never chooses",
        default=0.25, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    token_dtype: str = doc(
        "dtype of the cached tokens on the device ('bfloat16' or 'float16': 2 bytes per value; "
        "'float32'); the probe computes in float32",
        default="bfloat16", validator=choices(*TOKEN_DTYPES),
    )
    seed: int = doc(
        "seed of the probes' initial weights and mini-batch order", default=0, validator=non_negative,
    )


def build(config: AttentiveProbeConfig, ctx: BuildContext) -> Evaluator:
    from octfw.plugins.evaluators.attentive_probe.evaluator import AttentiveProbeEvaluator

    return AttentiveProbeEvaluator.from_config(config, ctx)


@hookimpl
def octfw_register_evaluators(register: Register) -> None:
    register(
        "attentive-probe",
        AttentiveProbeConfig,
        build,
        "V-JEPA's attentive probe on frozen patch tokens, a learning rate x weight decay grid "
        "trained together until validation stops improving; the member is chosen on validation.",
    )
