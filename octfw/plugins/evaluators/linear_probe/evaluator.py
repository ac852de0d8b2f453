"""The ``linear-probe`` evaluator's class (imports torch: loaded when the evaluator is built)."""

from __future__ import annotations

from octfw.evaluation.classification import PooledClassificationEvaluator
from octfw.plugins.evaluators.linear_probe.algorithm import fit_linear_probe

class LinearProbeEvaluator(PooledClassificationEvaluator):
    """A linear probe on the mean of the tokens (``accuracy``, ...) and on the pooled tokens
    concatenated (``tokens_accuracy``, ...): a weight per token position and channel, so a
    finding that only a few tokens see is not averaged away."""

    component = "linear-probe"

    def classify(self, train_features, train_targets, test_features, n_classes, reading):
        probe = fit_linear_probe(train_features.flatten(1), train_targets, n_classes,
                                 l2=self.config.l2, max_iter=self.config.max_iter)
        return probe.probabilities(test_features.flatten(1))
