"""The ``dense-probe`` evaluator's class (imports torch: loaded when the evaluator is built)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np
import torch

from octfw.display.errors import UserError
from octfw.evaluation.features import map_volumes, stratified_split, validation_split
from octfw.evaluation.metrics import overlap_difference, overlap_metrics
from octfw.evaluation.segmentation import MaskedVolumes, check_masks_early, dense_inputs, load_masked
from octfw.display.tables import counted
from octfw.types import BuildContext, EmbeddingModel


@attrs.frozen(eq=False)
class DenseEncoded:
    """Both splits as the heads are fitted on them, on the device they are fitted on."""

    train_tokens: torch.Tensor  #: [N_train, T, E] frozen tokens
    test_tokens: torch.Tensor
    train_patches: torch.Tensor  #: [N_train, T, pd x ph x pw] bool, the prepared masks patchified
    test_patches: torch.Tensor
    #: a snapshot of the encoder and the volumes [N, C, D, H, W] it reads, for fine-tuning; None without
    network: torch.nn.Module | None = None
    train_volumes: torch.Tensor | None = None
    test_volumes: torch.Tensor | None = None


class DenseProbeEvaluator:
    """The finding mask predicted from the encoder's tokens, at token and at voxel resolution,
    from frozen tokens and (``fine_tune_epochs`` > 0) with the encoder fine-tuned
    (:mod:`octfw.plugins.evaluators.dense_probe.algorithm`); Dice and IoU on the test split with
    patient-level bootstrap intervals. A :class:`~octfw.types.RefittingEvaluator`: the split's
    labels are "holds the finding", so ``--shots k`` fits on k volumes with it and k without.
    """

    component = "dense-probe"

    def __init__(self, config: Any, train_dataset: Any, test_dataset: Any | None, transform: Any,
                 patch_size: tuple[int, int, int], grid: tuple[int, int, int]):
        self.config = config
        self.every_steps: int | None = config.every_steps
        self.train_dataset, self.test_dataset, self.transform = train_dataset, test_dataset, transform
        self.patch_size, self.grid = patch_size, grid
        self._split: tuple[MaskedVolumes, MaskedVolumes] | None = None
        self._fit_val: tuple[np.ndarray, np.ndarray] | None = None
        #: per test volume counts ``[N, 3]`` of the newest :meth:`score`, by metric prefix, for :meth:`difference`
        self.last_test_probabilities: dict[str, np.ndarray] | None = None

    @classmethod
    def from_config(cls, config: Any, ctx: BuildContext) -> "DenseProbeEvaluator":
        inputs = dense_inputs(config, ctx, f"evaluator {cls.component}", check_masks_early)
        return cls(config, inputs.train, inputs.test, inputs.transform, inputs.patch_size, inputs.grid)

    @property
    def split_seed(self) -> int:
        return self.config.split_seed

    # --- data ----------------------------------------------------------------

    def split(self) -> tuple[MaskedVolumes, MaskedVolumes]:
        """(train, test) volumes with masks; decoded, prepared and split at the first call only,
        by patient, stratified by domain and finding."""
        if self._split is not None:
            return self._split
        where = f"evaluator {self.component}"
        volumes = load_masked(self.train_dataset, self.transform, where=f"{where}: dataset")
        if self.test_dataset is None:
            train_pos, test_pos = stratified_split(volumes.labels, volumes.domains, self.config.train_fraction,
                                                   self.config.split_seed, groups=volumes.groups)
            train, test = volumes.subset(train_pos), volumes.subset(test_pos)
        else:
            train = volumes
            test = load_masked(self.test_dataset, self.transform, where=f"{where}: test_dataset")
        if not train.labels.any():
            raise UserError(f"{where}: no train volume holds any of the finding (all "
                            f"{counted(len(train), 'mask')} empty after preparation); nothing to learn")
        if len(test) == 0:
            raise UserError(f"{where}: the test split is empty; use more volumes or a test_dataset")
        self._split = (train, test)
        return self._split

    def fit_val_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(fit positions, validation positions) in the train split; drawn once, seeded, whole patients."""
        if self._fit_val is None:
            self._fit_val = validation_split(self.split()[0], self.config.val_fraction, self.config.split_seed,
                                             self.component)
        return self._fit_val

    def fit_positions(self) -> np.ndarray:
        """Positions in the train split the heads may be fitted on; the validation split stays whole."""
        return self.fit_val_positions()[0]

    # --- evaluation --------------------------------------------------------

    def _patches(self, volumes: MaskedVolumes, device: Any) -> torch.Tensor:
        from octfw.plugins.evaluators.dense_probe.algorithm import patchify

        masks = torch.from_numpy(np.stack(volumes.masks))
        return patchify(masks, self.patch_size).to(device)

    def _tokens(self, model: Any, volumes: MaskedVolumes, device: Any) -> torch.Tensor:
        """Frozen tokens ``[N, T, E]`` (float32, on ``device``): ``model.embed`` (else ``model``)."""
        encode = model.embed if isinstance(model, EmbeddingModel) else model
        was_training = bool(getattr(model, "training", False))
        if isinstance(model, torch.nn.Module):
            model.eval()
        try:
            tokens = map_volumes(encode, volumes, device, self.config.batch_size)
        finally:
            if was_training:
                model.train()
        if tokens.ndim != 3 or tokens.shape[1] != math.prod(self.grid):
            raise UserError(f"evaluator {self.component}: the encoder returned features of shape "
                            f"{list(tokens.shape)}; a dense probe needs one token per patch of the "
                            f"{'x'.join(map(str, self.grid))} grid [B, {math.prod(self.grid)}, E]")
        return tokens

    def encode(self, model: Any, device: Any) -> DenseEncoded:
        """Frozen tokens of both splits and, for fine-tuning, a snapshot of the encoder."""
        from octfw.evaluation.fine_tuning import encoder_to_fine_tune

        train, test = self.split()
        tokens = (self._tokens(model, train, device), self._tokens(model, test, device))
        patches = (self._patches(train, device), self._patches(test, device))
        if self.config.fine_tune_epochs == 0:
            return DenseEncoded(*tokens, *patches)
        encoder = encoder_to_fine_tune(model, f"evaluator {self.component}",
                                       " (set fine_tune_epochs = 0 for frozen tokens only)")
        # A snapshot: the caller's encoder may train on (the engine) or leave the device (octfw eval).
        import copy

        snapshot = copy.deepcopy(encoder).to(device).eval()
        return DenseEncoded(*tokens, *patches, network=snapshot,
                            train_volumes=torch.from_numpy(np.stack(train.volumes)).to(device),
                            test_volumes=torch.from_numpy(np.stack(test.volumes)).to(device))

    def score(self, encoded: DenseEncoded, positions: np.ndarray | None = None) -> dict[str, float]:
        """Fit on the train volumes at ``positions`` (default :meth:`fit_positions`), measure on test:
        ``voxel_dice``, ``voxel_iou``, ``token_dice``, ``token_iou`` (frozen tokens) and, with
        fine-tuning, the same prefixed ``fine_tune_``; each with its interval and per domain."""
        from octfw.plugins.evaluators.dense_probe.algorithm import fit_dense

        config = self.config
        train, test = self.split()
        positions = self.fit_positions() if positions is None else np.asarray(positions, dtype=np.int64)
        val = self.fit_val_positions()[1]
        device = encoded.train_tokens.device
        fit_index, val_index = (torch.from_numpy(p).to(device) for p in (positions, val))
        sync = _xla_sync if torch.device(device).type == "xla" else None
        runs = [("", None, encoded.train_tokens, encoded.test_tokens, config.epochs, config.lr, 0.0)]
        if encoded.network is not None:
            runs.append(("fine_tune_", encoded.network, encoded.train_volumes, encoded.test_volumes,
                         config.fine_tune_epochs, config.fine_tune_lr, config.weight_decay))
        out: dict[str, float] = {}
        kept: dict[str, np.ndarray] = {}
        heads = None  # fine-tuning starts from the frozen fit's heads
        for prefix, encoder, train_inputs, test_inputs, epochs, lr, weight_decay in runs:
            result = fit_dense(train_inputs[fit_index], encoded.train_patches[fit_index],
                               train_inputs[val_index], encoded.train_patches[val_index],
                               test_inputs, encoded.test_patches, encoded.train_tokens.shape[-1],
                               encoder=encoder, heads=heads, token_target=config.token_target, epochs=epochs,
                               batch_size=config.fit_batch_size, lr=lr, layer_decay=config.layer_decay,
                               weight_decay=weight_decay, seed=config.seed, eval_batch_size=config.batch_size,
                               sync=sync)
            for resolution, counts in (("voxel", result.voxel), ("token", result.token)):
                out.update(overlap_metrics(*counts, test.domains, prefix=f"{prefix}{resolution}_",
                                           groups=test.groups, bootstrap=config.bootstrap, seed=config.split_seed))
                kept[f"{prefix}{resolution}_"] = np.stack([np.asarray(c, dtype=np.float64) for c in counts], axis=1)
            heads = result.heads
            out[f"{prefix}selected_epoch"] = float(result.selected_epoch)
            out[f"{prefix}val_dice"] = result.val_dice
            out[f"{prefix}trained_parameters"] = float(result.trained_parameters)
        self.last_test_probabilities = kept  # per test volume, for the paired difference (octfw eval)
        return out

    def difference(self, first: Mapping[str, np.ndarray], second: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Dice and IoU of two networks' kept test counts (``last_test_probabilities``), first minus
        second, with a paired patient-bootstrap interval; ``[F, N, 3]`` counts: the mean over fits."""
        test = self.split()[1]
        out: dict[str, float] = {}
        for prefix in first:
            out.update(overlap_difference(first[prefix], second[prefix], test.domains, prefix=prefix,
                                          groups=test.groups, bootstrap=self.config.bootstrap,
                                          seed=self.config.split_seed))
        return out

    def evaluate(self, model: Any, device: Any, update_step: int) -> dict[str, float]:
        return self.score(self.encode(model, device))


def _xla_sync() -> None:
    import torch_xla

    torch_xla.sync()  # one graph per step, not one over the whole fit
