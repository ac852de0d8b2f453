"""The ``knn`` evaluator: k-nearest neighbours on frozen encoder features.

Config, factory and registration; the class is :mod:`.evaluator`, the algorithm :mod:`.algorithm`,
the base they share :mod:`octfw.evaluation.classification`.
"""

from __future__ import annotations

import attrs

from octfw.evaluation.config import ReadingEvaluatorConfig
from octfw.recipe.fields import choices, doc, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Evaluator

__all__ = ["KNNConfig", "build"]


@attrs.frozen
class KNNConfig(ReadingEvaluatorConfig):
    """k-nearest neighbours by cosine similarity of centred target-encoder features: the mean over
    a volume's tokens, its pooled tokens (each centred and normalised, then concatenated), or
    both (``reading``)."""

    k: int = doc(
        "neighbours that vote (capped at the size of the train split)", default=10, validator=positive,
    )
    weighting: str = doc(
        "'uniform' (majority vote) or 'similarity' (each vote weighted exp(cosine / temperature))",
        default="similarity", validator=choices("uniform", "similarity"),
    )
    temperature: float = doc(
        "temperature of the similarity weighting", default=0.07, validator=positive,
    )


def build(config: KNNConfig, ctx: BuildContext) -> Evaluator:
    from octfw.plugins.evaluators.knn.evaluator import KNNEvaluator

    return KNNEvaluator.from_config(config, ctx)


@hookimpl
def octfw_register_evaluators(register: Register) -> None:
    register(
        "knn",
        KNNConfig,
        build,
        "k-nearest neighbours (cosine) on frozen encoder features of a labelled dataset: the "
        "mean of the tokens, the tokens, or both.",
    )
