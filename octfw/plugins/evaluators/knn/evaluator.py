"""The ``knn`` evaluator's class (imports torch: loaded when the evaluator is built)."""

from __future__ import annotations

from octfw.evaluation.classification import PooledClassificationEvaluator
from octfw.plugins.evaluators.knn.algorithm import knn_probabilities

class KNNEvaluator(PooledClassificationEvaluator):
    component = "knn"

    def classify(self, train_features, train_targets, test_features, n_classes):
        return knn_probabilities(train_features, train_targets, test_features, n_classes,
                                 k=self.config.k, weighting=self.config.weighting,
                                 temperature=self.config.temperature)
