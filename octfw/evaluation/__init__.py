"""Frozen-encoder evaluation: labelled volumes -> features or tokens -> probe or kNN -> metrics.

The shared library and what ``octfw eval`` runs; each evaluator component is a
package of :mod:`octfw.plugins.evaluators` (its config, class, algorithm and
registration together).

The library:

- :mod:`octfw.evaluation.config`: the options every feature evaluator shares
  and the nested component tables (``dataset = { name = ... }``); light.
- :mod:`octfw.evaluation.features`: labelled volumes prepared as in training,
  a stratified train/test split (whole patients when the dataset knows
  them), batched extraction of mean-pooled features or pooled patch tokens.
- :mod:`octfw.evaluation.metrics`: accuracy, balanced accuracy, AUROC, AUPRC,
  bootstrap intervals, per domain.
- :mod:`octfw.evaluation.shots`: label efficiency (k labelled volumes per class).
- :mod:`octfw.evaluation.curves`: PNGs of label efficiency and of a metric
  over checkpoints.
- :mod:`octfw.evaluation.classification`: the base of the classification
  evaluators (split, encode, fit, score with bootstrap intervals, refit for
  ``--shots``); a dense evaluator implements :class:`octfw.types.Evaluator`
  beside it.

``octfw eval``:

- :mod:`octfw.evaluation.target`: a checkpoint or an exported encoder
  against a randomly initialised encoder of the same architecture.
- :mod:`octfw.evaluation.compare`: several encoders side by side.
- :mod:`octfw.evaluation.reporting`: what every report states (the test
  split, intervals, differences from random init).
- :mod:`octfw.evaluation.label_efficiency`: ``--shots``.
- :mod:`octfw.evaluation.checkpoints`: ``--checkpoints``, a metric over the
  saved checkpoints of a run.

Only ``config`` may be imported where torch must not be (the evaluator
registrations, recipe validation); the others import torch or numpy at import (``curves``
imports matplotlib only when drawing).
"""
