"""Built-in evaluators: measure the frozen encoder on labelled data.

Each fits a classifier on target-encoder features of a labelled dataset,
prepared exactly as training prepares its volumes: mean-pooled features
(``linear-probe``, ``knn``) or patch tokens (``attentive-probe``). Each
reports accuracy, balanced accuracy, AUROC and AUPRC (with bootstrap 95 %
intervals) on held-out volumes, overall and per domain.
"""

from __future__ import annotations

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.evaluators import attentive_probe, knn, linear_probe


@hookimpl
def octfw_register_evaluators(register: Register) -> None:
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
    register(
        "attentive-probe",
        attentive_probe.AttentiveProbeConfig,
        "octfw.plugins.evaluators.attentive_probe:build",
        "Attentive probes (learned queries over frozen patch tokens), a learning rate x weight decay "
        "grid trained in one pass; the member is chosen on a validation split.",
    )
