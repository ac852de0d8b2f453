"""Built-in evaluators: measure the frozen encoder on labelled data.

Both fit a classifier on mean-pooled target-encoder features of a labelled
dataset, prepared exactly as training prepares its volumes, and report
accuracy, balanced accuracy and (for two classes) AUROC on held-out volumes,
overall and per domain.
"""

from __future__ import annotations

from octfw.hookspecs import hookimpl
from octfw.plugins.evaluators import knn, linear_probe


@hookimpl
def octfw_register_evaluators(register):
    register(
        "linear-probe",
        linear_probe.LinearProbeConfig,
        "octfw.plugins.evaluators.linear_probe:build",
        "Logistic regression on frozen, mean-pooled encoder features of a labelled dataset.",
    )
    register(
        "knn",
        knn.KNNConfig,
        "octfw.plugins.evaluators.knn:build",
        "k-nearest neighbours (cosine) on frozen, mean-pooled encoder features of a labelled dataset.",
    )
