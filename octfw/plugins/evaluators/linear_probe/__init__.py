"""The ``linear-probe`` evaluator: logistic regression on frozen encoder features (their mean,
their tokens concatenated, or both).

Config, factory and registration; the class is :mod:`.evaluator`, the algorithm :mod:`.algorithm`,
the base they share :mod:`octfw.evaluation.classification`.
"""

from __future__ import annotations

import attrs

from octfw.evaluation.config import ReadingEvaluatorConfig
from octfw.recipe.fields import doc, non_negative, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Evaluator

__all__ = ["LinearProbeConfig", "build"]


@attrs.frozen
class LinearProbeConfig(ReadingEvaluatorConfig):
    """Multinomial logistic regression on standardised target-encoder features: the mean over a
    volume's tokens, its pooled tokens concatenated, or both (``reading``)."""

    l2: float = doc(
        "L2 penalty on the weights, added to the mean cross-entropy as l2 / 2 x |W|^2 "
        "(features are standardised on the train split first)",
        default=1e-2, validator=non_negative,
    )
    max_iter: int = doc(
        "LBFGS iterations (full batch, strong Wolfe line search, from zero weights: deterministic)",
        default=200, validator=positive,
    )


def build(config: LinearProbeConfig, ctx: BuildContext) -> Evaluator:
    from octfw.plugins.evaluators.linear_probe.evaluator import LinearProbeEvaluator

    return LinearProbeEvaluator.from_config(config, ctx)


@hookimpl
def octfw_register_evaluators(register: Register) -> None:
    register(
        "linear-probe",
        LinearProbeConfig,
        build,
        "Logistic regression on frozen encoder features of a labelled dataset: the mean of the "
        "tokens, the tokens concatenated, or both.",
    )
