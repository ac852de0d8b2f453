"""Frozen-encoder evaluation: labelled volumes -> pooled features -> probe or kNN.

Modules:

- :mod:`octfw.evaluation.config`: the options every feature evaluator shares
  and the nested component tables (``dataset = { name = ... }``); light.
- :mod:`octfw.evaluation.features`: labelled volumes prepared as in training,
  a stratified train/test split, batched feature extraction.
- :mod:`octfw.evaluation.probe`: multinomial logistic regression (LBFGS, L2).
- :mod:`octfw.evaluation.knn`: k-nearest neighbours with cosine similarity.
- :mod:`octfw.evaluation.metrics`: accuracy, balanced accuracy, AUROC, per domain.
- :mod:`octfw.evaluation.evaluator`: the evaluators the ``linear-probe`` and
  ``knn`` components build.
- :mod:`octfw.tools.evaluate`: ``octfw eval``: a checkpoint against a
  randomly initialised encoder of the same architecture.

Only ``config`` may be imported where torch must not be (plugin modules,
recipe validation); the others import torch.
"""
