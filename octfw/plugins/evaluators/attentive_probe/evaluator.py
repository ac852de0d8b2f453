"""The ``attentive-probe`` evaluator's class (imports torch: loaded when the evaluator is built)."""

from __future__ import annotations

from typing import Any

import torch

from octfw.display.errors import UserError
from octfw.evaluation.classification import Encoded, ValidatedClassificationEvaluator
from octfw.evaluation.features import extract_tokens

class AttentiveProbeEvaluator(ValidatedClassificationEvaluator):
    """V-JEPA's attentive probe on cached patch tokens; the grid is trained until the validation
    split stops improving, and the member is chosen there.

    The members are fitted on the train split less its validation split, each
    kept at its best validation epoch; the one with the best validation
    balanced accuracy is measured on the test split, and only that one: the
    test split never picks a member or an epoch. Besides the test metrics it
    reports the chosen ``selected_lr``, ``selected_weight_decay``,
    ``selected_epoch`` (1-based), its ``val_balanced_accuracy`` and the
    ``epochs_trained`` before training stopped.
    """

    component = "attentive-probe"

    def encode(self, model: Any, device: Any) -> Encoded:
        # Tokens stay on the training device: the probe trains there in fixed-shape
        # mini-batches (one XLA graph), with a sync per step.
        train, test = self.split()
        dtype = getattr(torch, self.config.token_dtype)
        options = dict(grid=self.grid, max_tokens=self.config.max_tokens, dtype=dtype)
        return Encoded(extract_tokens(model, train, device, self.config.batch_size, **options),
                       extract_tokens(model, test, device, self.config.batch_size, **options))

    def fit_and_predict(self, encoded, positions, classes):
        from octfw.plugins.evaluators.attentive_probe.algorithm import fit_attentive_grid, select_member

        config = self.config
        if encoded.train.shape[-1] % config.num_heads:
            raise UserError(f"evaluator {self.component}: num_heads = {config.num_heads} does not divide "
                            f"the encoder's width {encoded.train.shape[-1]}")
        fit_tokens, fit_targets = self._train_part(encoded, positions, classes)
        val_tokens, val_targets = self._train_part(encoded, self.fit_val_positions()[1], classes)
        grid = fit_attentive_grid(fit_tokens, fit_targets, val_tokens, val_targets, len(classes),
                                  learning_rates=config.learning_rates, weight_decays=config.weight_decays,
                                  num_heads=config.num_heads, max_epochs=config.max_epochs,
                                  patience=config.patience, batch_size=config.fit_batch_size, seed=config.seed)
        selection = select_member(grid, val_tokens, val_targets)
        lr, weight_decay = grid.members[selection.chosen]
        if selection.degenerate:
            self._warn_single_class("every member of the grid", len(val_targets))
        extra = {"selected_lr": lr, "selected_weight_decay": weight_decay,
                 "selected_epoch": float(grid.best_epoch[selection.chosen]),
                 "epochs_trained": float(grid.epochs_trained),
                 "val_balanced_accuracy": float(selection.balanced_accuracy[selection.chosen]),
                 "single_class": float(selection.degenerate),
                 "single_class_members": float(sum(selection.single_class))}
        return grid.probabilities(encoded.test, selection.chosen), extra
