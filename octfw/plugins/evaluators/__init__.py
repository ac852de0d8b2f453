"""Evaluators (recipe tables ``[[evaluator]]``): measure the encoder on labelled data.

Each fits a classifier on target-encoder features of a labelled dataset,
prepared exactly as training prepares its volumes: mean-pooled features
(``linear-probe``, ``knn``) or patch tokens (``attentive-probe``); or
fine-tunes a copy of the target encoder on the volumes (``fine-tune``). Each
reports accuracy, balanced accuracy, AUROC and AUPRC (with bootstrap 95 %
intervals) on held-out volumes, overall and per domain. ``dense-probe`` predicts
a finding's mask from the tokens instead (per token and per voxel, frozen and
fine-tuned) and reports Dice and IoU; ``layer-segmentation`` predicts every voxel's
retinal layer with a light decoder on the frozen or fine-tuned encoder and reports
Dice per layer and the boundary error in micrometres, per vendor and across vendors.

One package per evaluator holds its config and registration (``__init__``,
light), its class (``evaluator``) and its algorithm (``algorithm``); the
classification base they share is :mod:`octfw.evaluation.classification`, the masked
volumes of a dense evaluator :mod:`octfw.evaluation.segmentation`."""
