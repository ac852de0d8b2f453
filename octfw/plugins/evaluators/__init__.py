"""Evaluators (recipe tables ``[[evaluator]]``): measure the encoder on labelled data.

Each fits a classifier on target-encoder features of a labelled dataset,
prepared exactly as training prepares its volumes: mean-pooled features
(``linear-probe``, ``knn``) or patch tokens (``attentive-probe``); or
fine-tunes a copy of the target encoder on the volumes (``fine-tune``). Each
reports accuracy, balanced accuracy, AUROC and AUPRC (with bootstrap 95 %
intervals) on held-out volumes, overall and per domain.

One module per evaluator holds its config and registration; the code they
share is :mod:`octfw.evaluation.evaluator`."""
