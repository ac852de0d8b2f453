"""The ``knn`` evaluator's class (imports torch: loaded when the evaluator is built)."""

from __future__ import annotations

from octfw.evaluation.classification import PooledClassificationEvaluator
from octfw.plugins.evaluators.knn.algorithm import knn_probabilities, knn_token_probabilities

class KNNEvaluator(PooledClassificationEvaluator):
    """kNN on the mean of the tokens (``accuracy``, ...) and on the pooled tokens
    (``tokens_accuracy``, ...)."""

    component = "knn"

    def classify(self, train_features, train_targets, test_features, n_classes, reading):
        vote = knn_token_probabilities if reading == "tokens" else knn_probabilities
        return vote(train_features, train_targets, test_features, n_classes, k=self.config.k,
                    weighting=self.config.weighting, temperature=self.config.temperature)
