"""The ``attentive-probe`` evaluator: learned-query attention over frozen patch tokens.

Config, factory and registration; the algorithm is :mod:`.algorithm`
and its class :class:`.evaluator.AttentiveProbeEvaluator`.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.evaluation.config import FeatureEvaluatorConfig
from octfw.fields import choices, doc, in_range, non_negative, positive
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
class AttentiveProbeConfig(FeatureEvaluatorConfig):
    """Attentive probes (learned queries over target-encoder patch tokens, then a linear
    classifier), one per learning rate x weight decay, trained together; the member is chosen
    on a validation split carved out of the train split, and measured on the test split."""

    learning_rates: tuple[float, ...] = doc(
        "peak AdamW learning rates of the grid (10 % linear warmup, then cosine to 0)",
        default=(1e-3, 3e-3, 1e-2, 3e-2), validator=_grid_values(0.0, open_low=True),
    )
    weight_decays: tuple[float, ...] = doc(
        "decoupled weight decays of the grid (on the value and classifier matrices); "
        "members = learning_rates x weight_decays",
        default=(0.01, 0.1, 1.0), validator=_grid_values(0.0, open_low=False),
    )
    num_heads: int = doc(
        "attention heads (learned queries); must divide the encoder's width", default=4, validator=positive,
    )
    epochs: int = doc(
        "passes over the fit volumes (every member sees the same mini-batches)", default=30, validator=positive,
    )
    fit_batch_size: int = doc(
        "volumes per probe update step (every step is full: an XLA graph compiles once)",
        default=16, validator=positive,
    )
    val_fraction: float = doc(
        "share of the train split held out to choose the grid member (stratified by domain and "
        "label, whole patients); the test split never chooses",
        default=0.25, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    max_tokens: int = doc(
        "patch tokens kept per volume: the patch grid is average-pooled (longest side halved) "
        "until at most this many cells remain; bounds the cache at volumes x max_tokens x width",
        default=64, validator=positive,
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
        "Attentive probes (learned queries over frozen patch tokens), a learning rate x "
        "weight decay grid trained in one pass; the member is chosen on a validation split.",
    )
