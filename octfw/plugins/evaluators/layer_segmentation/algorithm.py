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
  few thousand parameters wide at CPU scale. The convolution blocks are MONAI's
  (``Convolution``, ``UnetBasicBlock``, ``UnetOutBlock``, as in MONAI's UNETR, but
  with ReLU and an affine instance norm); the upsampling is this module's own,
  since MONAI's ``UnetrPrUpBlock`` doubles per stage with full transposed
  convolutions, which neither fits an anisotropic patch nor stays this small;
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
compound loss, MONAI's ``DiceCELoss``: :func:`segmentation_loss`); AdamW,
full batches (the epoch's permutation wraps around), 10 % warmup then a cosine, for ``epochs`` passes or ``min_steps`` updates,
whichever is more: passes alone give one labelled volume 30 updates where
twenty get 150 (the linear decoder needed about 1,000 on the ``held-out``
family). The mean Dice of the foreground layers on the validation
volumes, scored at ``validations`` evenly spaced steps (a fixed cost, whatever
the fit's length), chooses the network (ties: the earlier); the test split
never chooses.

Metrics: :mod:`.metrics`.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch
from monai.losses import DiceCELoss
from monai.networks.blocks import Convolution, UnetBasicBlock, UnetOutBlock
from torch import nn

from octfw.evaluation.attentive import decayed, epoch_order
from octfw.evaluation.fine_tuning import ALL_BLOCKS, parameter_groups, unfreeze_trained_part
from octfw.plugins.evaluators.layer_segmentation.metrics import mean_dice, segmentation_counts
from octfw.display.progress import fit_step
from octfw.engine.schedules import warmup_cosine
from octfw.types import BlockwiseEncoder

__all__ = ["DECODERS", "tap_depths", "frozen_part", "UNETRDecoder", "LinearDecoder", "build_decoder", "SegmentationNetwork",
           "segmentation_groups", "SegmentationResult", "segmentation_loss", "fit_segmentation", "validation_steps"]

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


#: UNETR's normalisation (instance norm) with a learned scale and shift, and ReLU (MONAI's default
#: for these blocks is LeakyReLU 0.01; ReLU is what this decoder was measured with).
_NORM, _ACT = ("instance", {"affine": True}), "relu"


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
        # The skip from the volume: one 3x3x3 convolution, instance norm, ReLU.
        self.stem = Convolution(3, channels, width, kernel_size=3, norm=_NORM, act=_ACT)
        # Two of them, then a 1x1x1 convolution to a logit per layer: MONAI's UnetBasicBlock and
        # UnetOutBlock (their 3x3x3 convolutions carry no bias, which the instance norm that
        # follows would cancel anyway).
        self.fuse = nn.Sequential(UnetBasicBlock(3, width * (taps + 1), width, kernel_size=3, stride=1,
                                                 norm_name=_NORM, act_name=_ACT),
                                  UnetOutBlock(3, width, classes))

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


def segmentation_loss() -> DiceCELoss:
    """Cross-entropy plus soft Dice (nnU-Net's compound loss) as MONAI computes it: the Dice over
    the softmax of the logits against the one-hot labels, every layer (the background too), its
    overlaps summed over the whole batch before the ratio (``batch=True``), smoothed by 1 above and
    below, averaged over the layers; the cross-entropy averaged over voxels; the two added.
    Called with logits ``[B, K, D, H, W]`` and labels ``[B, 1, D, H, W]``."""
    return DiceCELoss(include_background=True, to_onehot_y=True, softmax=True, batch=True, smooth_nr=1.0,
                      smooth_dr=1.0, reduction="mean", lambda_dice=1.0, lambda_ce=1.0)


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
    loss_of = segmentation_loss()
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
            logits = network(*(x[batch].to(device) for x in fit)).float()
            loss = loss_of(logits, fit_labels[batch].to(device)[:, None])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if sync is not None:
                sync()
            fit_step(step, total)  # octfw eval's progress, where one listens
            if step in checks:
                network.eval()  # a host sync per validation
                predicted = _predict(network, val, eval_batch_size, device)
                val_mean = mean_dice(segmentation_counts(predicted.numpy(), val_truth, classes)["dice"])
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
