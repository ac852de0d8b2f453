"""The ``fine-tune`` evaluator's class (imports torch: loaded when the evaluator is built)."""

from __future__ import annotations

from typing import Any

import torch

from octfw.display.errors import UserError
from octfw.evaluation.classification import Encoded, ValidatedClassificationEvaluator
from octfw.evaluation.features import map_volumes

class FineTuneEvaluator(ValidatedClassificationEvaluator):
    """The encoder fine-tuned with a head (:mod:`octfw.plugins.evaluators.fine_tune.algorithm`); the epoch is
    chosen on a validation split, and only its network predicts the test split.

    Besides the test metrics it reports ``selected_epoch`` (1-based), its
    ``val_balanced_accuracy`` and the number of ``trained_parameters``.
    """

    component = "fine-tune"

    def encode(self, model: Any, device: Any) -> Encoded:
        import copy

        from octfw.evaluation.fine_tuning import ALL_BLOCKS, encoder_to_fine_tune
        from octfw.plugins.evaluators.fine_tune.algorithm import frozen_prefix

        where = f"evaluator {self.component}"
        encoder = encoder_to_fine_tune(model, where)
        if encoder.embed_dim % self.config.num_heads:
            raise UserError(f"{where}: num_heads = {self.config.num_heads} does not divide the encoder's "
                            f"width {encoder.embed_dim}")
        blocks, depth = self.config.blocks, len(encoder.blocks)
        if blocks != ALL_BLOCKS and blocks > depth:
            raise UserError(f"{where}: blocks = {blocks}, but the encoder has {depth} blocks; "
                            f"give 1 to {depth}, or 'all'")
        # A snapshot: the caller's encoder may train on (the engine) or move off the device
        # (octfw eval) before the fits; every fit copies this one again.
        encoder = copy.deepcopy(encoder).to(device).eval()
        train, test = self.split()

        def inputs(volumes: torch.Tensor) -> torch.Tensor:
            return frozen_prefix(encoder, blocks, volumes)

        return Encoded(map_volumes(inputs, train, device, self.config.batch_size),
                       map_volumes(inputs, test, device, self.config.batch_size), network=encoder)

    def fit_and_predict(self, encoded, positions, classes):
        from octfw.plugins.evaluators.fine_tune.algorithm import fine_tune

        config = self.config
        fit_inputs, fit_targets = self._train_part(encoded, positions, classes)
        val_inputs, val_targets = self._train_part(encoded, self.fit_val_positions()[1], classes)
        result = fine_tune(encoded.network, fit_inputs, fit_targets, val_inputs, val_targets, encoded.test,
                           len(classes), blocks=config.blocks, epochs=config.epochs,
                           batch_size=config.fit_batch_size, lr=config.lr, layer_decay=config.layer_decay,
                           weight_decay=config.weight_decay, num_heads=config.num_heads,
                           head_epochs=config.head_epochs, head_lr=config.head_lr, seed=config.seed,
                           eval_batch_size=config.batch_size)
        if result.single_class:
            self._warn_single_class("at every epoch the network", len(val_targets))
        extra = {"selected_epoch": float(result.selected_epoch),
                 "val_balanced_accuracy": result.val_balanced_accuracy,
                 "trained_parameters": float(result.trained_parameters),
                 "single_class": float(result.single_class)}
        return result.test_probabilities, extra
