"""Frozen-encoder evaluation: labelled volumes -> features or tokens -> probe or kNN -> metrics.

Everything evaluation is here: the library, the evaluator components
(:mod:`octfw.plugins.evaluators`) and what ``octfw eval`` runs.

The library:

- :mod:`octfw.evaluation.config`: the options every feature evaluator shares
  and the nested component tables (``dataset = { name = ... }``); light.
- :mod:`octfw.evaluation.features`: labelled volumes prepared as in training,
  a stratified train/test split (whole patients when the dataset knows
  them), batched extraction of mean-pooled features or pooled patch tokens.
- :mod:`octfw.evaluation.probe`: multinomial logistic regression (LBFGS, L2).
- :mod:`octfw.evaluation.knn`: k-nearest neighbours with cosine similarity.
- :mod:`octfw.evaluation.attentive`: attentive probes, a learning rate x
  weight decay grid trained in one pass, and the choice on validation.
- :mod:`octfw.evaluation.fine_tune`: the encoder fine-tuned with a head,
  layer-wise learning-rate decay, the epoch chosen on validation.
- :mod:`octfw.evaluation.metrics`: accuracy, balanced accuracy, AUROC, AUPRC,
  bootstrap intervals, per domain.
- :mod:`octfw.evaluation.shots`: label efficiency (k labelled volumes per class).
- :mod:`octfw.evaluation.curves`: PNGs of label efficiency and of a metric
  over checkpoints.
- :mod:`octfw.evaluation.evaluator`: the evaluators the ``linear-probe``,
  ``knn``, ``attentive-probe`` and ``fine-tune`` components build.

``octfw eval``:

- :mod:`octfw.evaluation.target`: a checkpoint or an exported encoder
  against a randomly initialised encoder of the same architecture.
- :mod:`octfw.evaluation.label_efficiency`: ``--shots``.
- :mod:`octfw.evaluation.checkpoints`: ``--checkpoints``, a metric over the
  saved checkpoints of a run.

Only ``config`` may be imported where torch must not be (the evaluator
registrations, recipe validation); the others import torch or numpy at import (``curves``
imports matplotlib only when drawing).
"""
