"""Layer segmentation: a light decoder from the encoder's tokens at several depths to voxel labels.

The network (:class:`SegmentationNetwork`) is the encoder, frozen or in part
trained, and a decoder chosen by name (:data:`DECODERS`):

- ``"unetr"``, after UNETR (Hatamizadeh et al., WACV 2022): the tokens after
  ``taps`` evenly spaced blocks (for 4 taps of a 12-block ViT: blocks 3, 6, 9
  and 12; the last through the encoder's final norm, the others through a
  LayerNorm of the decoder's own) are reshaped to the patch grid, projected to
  ``width`` channels and brought to the voxel grid by a transposed convolution
  whose kernel and stride are the patch size, one kernel per channel (UNETR
  upsamples by 2 per stage from a 16-voxel cubic patch, with full transposed
  convolutions; one stage of patch stride serves any anisotropic OCT patch,
  e.g. 4 x 16 x 16, and per channel it costs ``width x pd x ph x pw`` weights,
  not ``width`` times that); a 3x3x3 convolution of the volume
  itself (UNETR's skip from the input) joins them, and two 3x3x3 convolutions
  (instance norm, ReLU) and a 1x1x1 one fuse the concatenation into a logit per
  layer and voxel. UNETR merges its skips stage by stage from coarse to fine;
  here all are at voxel resolution and merged once, which keeps the decoder a
  few thousand parameters wide at CPU scale;
- ``"linear"``: one linear layer per token of the final (normed) output to a
  logit per layer and voxel of its own patch (MAE's pixel decoder, the
  ``dense-probe`` voxel decoder made multi-class), nothing shared between
  patches: how much of the layering the final tokens alone carry.

What trains: the decoder alone on tokens computed once (``blocks = 0``, the
encoder frozen), or with the last ``k`` blocks and the final norm
(``blocks = k``), or the whole encoder (``"all"``), with layer-wise
learning-rate decay (:func:`octfw.evaluation.fine_tuning.parameter_groups`:
block ``i`` of ``L`` at ``lr x layer_decay ** (L - i)``, the patch embedding
``... ** (L + 1)``, the decoder and final norm at ``lr``). The frozen part runs
once (:func:`frozen_part`, with the encoder's own ``input_tokens`` and
``run_blocks``): its output tokens and the taps it passes are cached.

The loss is cross-entropy plus a soft Dice over the layers (nnU-Net's
compound loss); AdamW, full batches (the epoch's permutation wraps around),
10 % warmup then a cosine, for ``epochs`` passes or ``min_steps`` updates,
whichever is more: passes alone give one labelled volume 30 updates where
twenty get 150 (the linear decoder needed about 1,000 on the ``held-out``
family). The mean Dice of the foreground layers on the validation
volumes, scored at ``validations`` evenly spaced steps (a fixed cost, whatever
the fit's length), chooses the network (ties: the earlier); the test split
never chooses.

Metrics (:func:`segmentation_counts`, :func:`segmentation_metrics`): Dice per
layer per volume, averaged over volumes (nnU-Net's convention; a layer absent
from both prediction and truth of a volume leaves that volume out of the
layer's mean); the mean Dice over the layers after the first (label 0, the
vitreous, is background and left out, as nnU-Net leaves out its background);
the boundary error: for the boundary above layer ``b`` and each A-scan (a
column along H), the boundary's position is the number of voxels labelled
below ``b`` (for layers ordered top to bottom, the first row of ``b`` or a
deeper layer), and the error is the absolute difference of the predicted and
the true position, in micrometres with the volume's axial spacing, averaged
over A-scans and volumes. 95 % intervals come from resampling whole patients.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Iterator, Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from octfw.evaluation.attentive import decayed, epoch_order
from octfw.evaluation.fine_tuning import ALL_BLOCKS, parameter_groups, unfreeze_trained_part
from octfw.evaluation.metrics import bootstrap_weights
from octfw.engine.schedules import warmup_cosine
from octfw.types import BlockwiseEncoder

__all__ = ["DECODERS", "tap_depths", "frozen_part", "UNETRDecoder", "LinearDecoder", "build_decoder", "SegmentationNetwork",
           "segmentation_groups", "SegmentationResult", "fit_segmentation", "segmentation_counts", "segmentation_metrics"]

DECODERS = ("unetr", "linear")
_BETAS = (0.9, 0.999)


def tap_depths(depth: int, taps: int) -> list[int]:
    """The block counts after which tokens are read: ``taps`` evenly spaced, the last ``depth``
    (12 blocks, 4 taps: 3, 6, 9, 12; fewer blocks than taps: every block)."""
    taps = min(taps, depth)
    return sorted({round(depth * (i + 1) / taps) for i in range(taps)})


def frozen_part(encoder: BlockwiseEncoder, start: int, taps: Sequence[int],
                volumes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run what does not train once: ``(the taps at or below block start, [B, n, T, E]; the tokens
    entering block start, [B, T, E])``. The last tap is normed with the encoder's norm."""
    tokens = encoder.input_tokens(volumes.float())
    read, done = [], 0
    for depth in [t for t in taps if t <= start]:
        tokens = encoder.run_blocks(tokens, done, depth)
        done = depth
        read.append(encoder.norm(tokens) if depth == len(encoder.blocks) else tokens)
    tokens = encoder.run_blocks(tokens, done, start)
    width = tokens.shape[-1]
    stacked = torch.stack(read, 1) if read else tokens.new_zeros(tokens.shape[0], 0, tokens.shape[1], width)
    return stacked.float(), tokens.float()


def _grid_volume(tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """``[B, T, E]`` -> ``[B, E, gd, gh, gw]`` (tokens in row-major (d, h, w) order)."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], *grid)


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(in_channels, out_channels, 3, padding=1),
                         nn.InstanceNorm3d(out_channels, affine=True), nn.ReLU())


class UNETRDecoder(nn.Module):
    """Tapped tokens and the volume -> logits ``[B, K, D, H, W]`` (see the module docstring)."""

    def __init__(self, embed_dim: int, taps: int, classes: int, patch_size: tuple[int, int, int],
                 grid: tuple[int, int, int], channels: int, width: int = 16):
        super().__init__()
        self.classes, self.grid = classes, grid
        self.norms = nn.ModuleList(nn.LayerNorm(embed_dim) for _ in range(taps - 1))
        self.up = nn.ModuleList(nn.Sequential(nn.Conv3d(embed_dim, width, 1),
                                              nn.ConvTranspose3d(width, width, patch_size, stride=patch_size,
                                                                 groups=width))
                                for _ in range(taps))
        self.stem = _conv_block(channels, width)
        self.fuse = nn.Sequential(_conv_block(width * (taps + 1), width), _conv_block(width, width),
                                  nn.Conv3d(width, classes, 1))

    def forward(self, taps: Sequence[torch.Tensor], volumes: torch.Tensor) -> torch.Tensor:
        normed = [norm(t) for norm, t in zip(self.norms, taps[:-1])] + [taps[-1]]
        maps = [up(_grid_volume(t, self.grid)) for up, t in zip(self.up, normed)]
        return self.fuse(torch.cat([self.stem(volumes.float()), *maps], 1))


class LinearDecoder(nn.Module):
    """The final tokens alone -> logits ``[B, K, D, H, W]``: a linear map of each token to its
    patch's voxels."""

    def __init__(self, embed_dim: int, classes: int, patch_size: tuple[int, int, int], grid: tuple[int, int, int]):
        super().__init__()
        self.classes, self.patch_size, self.grid = classes, patch_size, grid
        self.linear = nn.Linear(embed_dim, classes * math.prod(patch_size))

    def forward(self, taps: Sequence[torch.Tensor], volumes: torch.Tensor) -> torch.Tensor:
        (gd, gh, gw), (pd, ph, pw) = self.grid, self.patch_size
        logits = self.linear(taps[-1].float())  # [B, T, K x pd x ph x pw]
        logits = logits.reshape(-1, gd, gh, gw, self.classes, pd, ph, pw)
        return logits.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(-1, self.classes, gd * pd, gh * ph, gw * pw)


def build_decoder(kind: str, embed_dim: int, taps: int, classes: int, patch_size: tuple[int, int, int],
                  grid: tuple[int, int, int], channels: int, width: int) -> "UNETRDecoder | LinearDecoder":
    if kind == "unetr":
        return UNETRDecoder(embed_dim, taps, classes, patch_size, grid, channels, width)
    return LinearDecoder(embed_dim, classes, patch_size, grid)


class SegmentationNetwork(nn.Module):
    """The decoder, and the encoder whose blocks from ``start`` on train (``None``: all frozen).

    ``forward(volumes, frozen_taps, start_tokens)``: the volumes ``[B, C, D, H, W]`` (the
    UNETR skip; the input of a whole encoder that trains), the taps :func:`frozen_part` cached
    and the tokens entering block ``start``.
    """

    def __init__(self, decoder: nn.Module, encoder: BlockwiseEncoder | None, blocks: int | str, taps: Sequence[int]):
        super().__init__()
        self.decoder = decoder
        self.encoder = encoder
        self.blocks, self.taps = blocks, list(taps)
        self.start = 0 if encoder is None else unfreeze_trained_part(encoder, blocks)

    def forward(self, volumes: torch.Tensor, frozen_taps: torch.Tensor, start_tokens: torch.Tensor) -> torch.Tensor:
        taps = list(frozen_taps.unbind(1))
        if self.encoder is not None:
            tokens = self.encoder.input_tokens(volumes.float()) if self.blocks == ALL_BLOCKS else start_tokens
            done, depth = self.start, len(self.encoder.blocks)
            for tap in [t for t in self.taps if t > self.start]:
                tokens = self.encoder.run_blocks(tokens, done, tap)
                done = tap
                taps.append(self.encoder.norm(tokens) if tap == depth else tokens)
        return self.decoder(taps, volumes)


def segmentation_groups(network: SegmentationNetwork, lr: float, layer_decay: float,
                        weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups of what trains: the layer-decayed groups the fine-tuning evaluators share
    (:func:`~octfw.evaluation.fine_tuning.parameter_groups`) with an encoder;
    the decoder alone (exponent 0) without."""
    if network.encoder is not None:
        return parameter_groups(network, lr, layer_decay, weight_decay)
    groups = []
    for decays in (True, False):
        named = [(n, p) for n, p in network.named_parameters() if decayed(p.shape) == decays]
        groups.append({"params": [p for _, p in named], "names": [n for n, _ in named], "exponent": 0,
                       "lr_scale": 1.0, "lr": lr, "weight_decay": weight_decay if decays else 0.0})
    return [g for g in groups if g["params"]]


@attrs.frozen(eq=False)
class SegmentationResult:
    predictions: torch.Tensor  #: int64 [N_test, D, H, W] of the selected network (host)
    selected_step: int  #: 1-based update step after which the selected network was validated
    val_mean_dice: float
    steps: int  #: update steps trained
    trained_parameters: int


def _soft_dice_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    probabilities = torch.softmax(logits.float(), 1)
    truth = F.one_hot(labels, logits.shape[1]).movedim(-1, 1).float()
    dims = (0, 2, 3, 4)
    overlap = (probabilities * truth).sum(dims)
    return 1 - ((2 * overlap + 1) / (probabilities.sum(dims) + truth.sum(dims) + 1)).mean()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels) + _soft_dice_loss(logits, labels)


def _predict(network: SegmentationNetwork, inputs: Sequence[torch.Tensor], batch_size: int,
             device: torch.device) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, inputs[0].shape[0], batch_size):
            out.append(network(*(x[start:start + batch_size].to(device) for x in inputs)).argmax(1).cpu())
    return torch.cat(out)


def fit_segmentation(
    decoder: "UNETRDecoder | LinearDecoder",
    encoder: BlockwiseEncoder | None,
    fit: Sequence[torch.Tensor],
    fit_labels: torch.Tensor,
    val: Sequence[torch.Tensor],
    val_labels: torch.Tensor,
    test: Sequence[torch.Tensor],
    *,
    blocks: int | str = 0,
    taps: Sequence[int] = (),
    epochs: int = 30,
    min_steps: int = 0,
    validations: int = 10,
    batch_size: int = 4,
    lr: float = 1e-3,
    layer_decay: float = 0.75,
    weight_decay: float = 0.05,
    seed: int = 0,
    eval_batch_size: int = 4,
    sync: Callable[[], None] | None = None,
    device: torch.device | str | None = None,
) -> SegmentationResult:
    """Train ``decoder`` (and, unless ``blocks`` is 0, a copy of ``encoder``) on ``fit`` (the
    network's inputs: volumes, frozen taps, start tokens) against ``fit_labels`` ``[N, D, H, W]``
    for ``epochs`` passes or ``min_steps`` update steps, whichever is more; score the validation
    volumes ``validations`` times, evenly spaced, the last after the last step, and return the
    test predictions of the best. ``decoder`` and ``encoder`` are not changed. The inputs may
    stay on the host: each batch goes to ``device`` (default: where ``fit`` is) when it is used."""
    device = torch.device(device) if device is not None else fit[0].device
    trains_encoder = blocks != 0
    network = SegmentationNetwork(copy.deepcopy(decoder), copy.deepcopy(encoder) if trains_encoder else None,
                                  blocks, taps).to(device)
    groups = segmentation_groups(network, lr, layer_decay, weight_decay)
    trained = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=_BETAS)
    generator = torch.Generator().manual_seed(seed)
    n = fit[0].shape[0]
    batch_size = min(batch_size, n)
    total = max(epochs * math.ceil(n / batch_size), min_steps)
    checks = validation_steps(total, validations)
    classes, val_truth = decoder.classes, val_labels.cpu().numpy()
    best: tuple[tuple[float, int], list[torch.Tensor]] | None = None
    batches: Iterator[torch.Tensor] = iter(())
    network.train()
    with torch.enable_grad():
        for step in range(1, total + 1):
            batch = next(batches, None)
            if batch is None:  # a new epoch: a new permutation of the fit volumes
                batches = iter(epoch_order(n, batch_size, generator))
                batch = next(batches)
            factor = warmup_cosine(step - 1, total)
            for group in groups:
                group["lr"] = lr * group["lr_scale"] * factor
            batch = batch.to(fit[0].device)  # the indices go where the inputs are, the rows to the device
            loss = _loss(network(*(x[batch].to(device) for x in fit)), fit_labels[batch].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if sync is not None:
                sync()
            if step in checks:
                network.eval()  # a host sync per validation
                predicted = _predict(network, val, eval_batch_size, device)
                val_mean = _mean_dice(segmentation_counts(predicted.numpy(), val_truth, classes)["dice"])
                key = (-val_mean, step)
                if best is None or key < best[0]:
                    best = (key, [p.detach().clone() for p in trained])
                network.train()
    assert best is not None  # the last step is always validated
    with torch.no_grad():
        for param, kept in zip(trained, best[1]):
            param.copy_(kept)
    network.eval()
    return SegmentationResult(_predict(network, test, eval_batch_size, device), best[0][1], -best[0][0], total,
                              sum(p.numel() for p in trained))


def validation_steps(total: int, validations: int) -> set[int]:
    """The 1-based steps after which a fit of ``total`` steps is validated: ``validations`` of them
    (at most ``total``), evenly spaced, the last step always among them."""
    count = min(validations, total)
    return {math.ceil(total * (i + 1) / count) for i in range(count)}


# --- metrics ---------------------------------------------------------------

def _mean_dice(dice: np.ndarray) -> float:
    """Mean over the foreground layers of each layer's mean over volumes (``dice`` ``[N, K]``);
    a layer undefined in every volume is left out, and 0 when all are."""
    with warnings.catch_warnings():  # an all-NaN column is a layer nowhere: left out by design
        warnings.simplefilter("ignore", RuntimeWarning)
        value = np.nanmean(np.nanmean(dice[:, 1:], axis=0))
    return 0.0 if np.isnan(value) else float(value)


def segmentation_counts(predicted: np.ndarray, truth: np.ndarray, classes: int) -> dict[str, np.ndarray]:
    """Per volume of ``predicted`` and ``truth`` (int ``[N, D, H, W]``): ``dice`` ``[N, K]`` (NaN
    where a layer is neither predicted nor true) and ``boundary`` ``[N, K - 1]``, the mean absolute
    difference (in voxels along H, per A-scan) of the boundary above layers 1 .. K-1."""
    n = predicted.shape[0]
    dice = np.full((n, classes), np.nan)
    boundary = np.zeros((n, max(classes - 1, 0)))
    for label in range(classes):
        p, t = predicted == label, truth == label
        both = (p & t).reshape(n, -1).sum(1)
        total = p.reshape(n, -1).sum(1) + t.reshape(n, -1).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            dice[:, label] = np.where(total > 0, 2 * both / np.maximum(total, 1), np.nan)
        if label > 0:  # the boundary above `label`: voxels of each A-scan (D, W column) labelled above it
            above_predicted = (predicted < label).sum(axis=2)
            above_true = (truth < label).sum(axis=2)
            boundary[:, label - 1] = np.abs(above_predicted - above_true).reshape(n, -1).mean(1)
    return {"dice": dice, "boundary": boundary}


def _weighted_nanmean(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``weights`` ``[B, N]`` over ``values`` ``[N, K]`` -> ``[B, K]``, NaN entries left out."""
    valid = ~np.isnan(values)
    total = weights @ valid.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (weights @ np.where(valid, values, 0.0)) / total, np.nan)


def _estimate(key: str, values: np.ndarray, resamples: int, out: dict[str, float], tail: str) -> None:
    if np.isnan(values[0]):
        return
    out[f"{key}{tail}"] = float(values[0])
    rest = values[1:]
    if resamples > 0 and np.count_nonzero(~np.isnan(rest)) > resamples / 2:
        low, high = np.nanpercentile(rest, [2.5, 97.5])
        out[f"{key}_ci_low{tail}"], out[f"{key}_ci_high{tail}"] = float(low), float(high)


def segmentation_metrics(
    predicted: np.ndarray,
    truth: np.ndarray,
    layer_keys: Sequence[str],
    axial_spacing_um: np.ndarray,
    domains: Sequence[str],
    *,
    prefix: str = "",
    groups: Sequence[object] | None = None,
    bootstrap: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """``<prefix>mean_dice``, ``<prefix>dice_<layer>`` per layer, ``<prefix>boundary_error_um`` (mean
    over boundaries) and ``<prefix>boundary_error_um_<upper>_<lower>`` per boundary; each with its
    patient-bootstrap 95 % interval (``_ci_low``/``_ci_high``) when ``bootstrap`` > 0, overall and
    per domain (``/<domain>``). ``axial_spacing_um`` is each volume's H spacing in µm."""
    counts = segmentation_counts(predicted, truth, len(layer_keys))
    boundary_um = counts["boundary"] * np.asarray(axial_spacing_um, dtype=np.float64)[:, None]
    domain_array = np.asarray(list(domains))
    group_array = None if groups is None else np.asarray([str(g) for g in groups])
    rng = np.random.default_rng(seed)
    out: dict[str, float] = {}
    subsets = [("", np.ones(len(domain_array), dtype=bool))]
    subsets += [(f"/{d}", domain_array == d) for d in sorted(set(domain_array.tolist()))]
    for tail, keep in subsets:
        weights = np.ones((1, int(keep.sum())))
        if bootstrap > 0:
            weights = np.concatenate([weights, bootstrap_weights(int(keep.sum()), bootstrap, rng,
                                                                 None if group_array is None else group_array[keep])])
        dice = _weighted_nanmean(counts["dice"][keep], weights)  # [B, K]
        errors = _weighted_nanmean(boundary_um[keep], weights)  # [B, K - 1]
        with warnings.catch_warnings():  # a row of NaN (nothing defined) gives NaN by design
            warnings.simplefilter("ignore", RuntimeWarning)
            _estimate(f"{prefix}mean_dice", np.nanmean(dice[:, 1:], axis=1), bootstrap, out, tail)
            _estimate(f"{prefix}boundary_error_um", np.nanmean(errors, axis=1), bootstrap, out, tail)
        for k, key in enumerate(layer_keys):
            _estimate(f"{prefix}dice_{key}", dice[:, k], bootstrap, out, tail)
        for k in range(1, len(layer_keys)):
            _estimate(f"{prefix}boundary_error_um_{layer_keys[k - 1]}_{layer_keys[k]}", errors[:, k - 1],
                      bootstrap, out, tail)
    return out

