"""The input published weights expect and the heads they were trained with, per source format.

The published encoders saw RGB frames scaled to [0, 1] and normalised per channel (V-JEPA 2
and 2.1, VideoMAE and RETFound with ImageNet's mean and std, MAE-ST with its Kinetics
loader's 0.45 / 0.225). octfw's volumes are grey [0, 1] intensities. ``init_channels``
chooses how the RGB patch projection meets them (:func:`channel_rule`):

- ``"sum"``: the kernel as published, its three channels summed for one: the published
  model shown the volume repeated in R, G and B, as the volume comes (standardised per
  volume with ``standardise_input``, the default).
- ``"fold"``: the normalisation folded into the kernel and bias first
  (:func:`~octfw.models.published.adapt.fold_normalisation`), so that raw [0, 1]
  intensities give the published model's tokens for the grey image normalised as it was
  trained. ``"auto"`` (the default) folds where ``standardise_input`` is off.

The fold is applied to the checkpoint's own tensors before its converter runs
(:func:`fold_checkpoint`): every converter then reads an ordinary checkpoint, of a network
that takes raw intensities. The report says what was folded, and when the recipe's input
is not the published one, says so in one line (:func:`input_note`).

A checkpoint does not record its attention heads. Where a source's published encoders of a
width all have one head count, another is refused (:func:`refuse_heads`).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from octfw.display.errors import UserError
from octfw.models.published.adapt import fold_normalisation
from octfw.models.published.report import InitReport

__all__ = ["Normalisation", "Family", "FAMILIES", "CHANNEL_RULES", "channel_rule", "fold_checkpoint",
           "note_fold", "input_note", "refuse_heads"]

#: ``init_channels`` choices (repeated in :mod:`octfw.models.presets`, which imports no torch).
CHANNEL_RULES = ("auto", "sum", "fold")

#: The checkpoint keys of a patch projection's kernel (octfw's, timm's and the references'
#: names, and Hugging Face transformers' VideoMAE name).
_KERNELS = ("patch_embed.proj.weight", "patch_embeddings.projection.weight")


@attrs.frozen
class Normalisation:
    """Per-channel ``(x - mean) / std`` of RGB intensities in [0, 1], as a source's loader applied it."""

    name: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def describe(self) -> str:
        return f"{self.name} mean {list(self.mean)} and std {list(self.std)} per RGB channel"


IMAGENET = Normalisation("ImageNet's", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
#: MAE-ST's Kinetics loader (``util/kinetics.py``: mean 0.45, std 0.225 for every channel).
KINETICS = Normalisation("MAE-ST's", (0.45, 0.45, 0.45), (0.225, 0.225, 0.225))


@attrs.frozen
class Family:
    """What a source format's published encoders were trained with: ``name`` in messages,
    their input ``normalisation``, and ``heads`` by encoder width (widths whose published
    encoders all have that many attention heads)."""

    name: str
    normalisation: Normalisation
    heads: Mapping[int, int]


#: By format name (:data:`octfw.models.published.FORMATS`). Heads from the references' model
#: functions of their published encoders: V-JEPA 2 (``src/hub/backbones.py``: ViT-L and ViT-H
#: 16, ViT-g ``vit_giant_xformers`` 22), V-JEPA 2.1 (ViT-B 12, ViT-L 16, ViT-g 22, ViT-G
#: ``vit_gigantic_xformers`` 26), VideoMAE (ViT-S 6, B 12, L 16, H 16; VideoMAE V2's ViT-g 16),
#: MAE-ST (ViT-L and ViT-H 16), MAE and RETFound (ViT-B 12, ViT-L 16, ViT-H 16). A format
#: absent here (a third party's) gets neither fold nor check.
FAMILIES: dict[str, Family] = {
    "vjepa2": Family("V-JEPA 2", IMAGENET, {1024: 16, 1280: 16, 1408: 22}),
    "vjepa2.1": Family("V-JEPA 2.1", IMAGENET, {768: 12, 1024: 16, 1408: 22, 1664: 26}),
    "videomae": Family("VideoMAE", IMAGENET, {384: 6, 768: 12, 1024: 16, 1280: 16, 1408: 16}),
    "mae-st": Family("MAE-ST", KINETICS, {1024: 16, 1280: 16}),
    "retfound": Family("RETFound (MAE)", IMAGENET, {768: 12, 1024: 16, 1280: 16}),
}


def _kernels(state: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Mapping[str, Any], str]]:
    """``(path, holder, key)`` of every patch kernel in the (nested) checkpoint ``state``."""
    found = []
    for key, value in state.items():
        if not isinstance(key, str):
            continue
        if isinstance(value, Mapping):
            found += _kernels(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor) and any(key == k or key.endswith("." + k) for k in _KERNELS):
            found.append((prefix + key, state, key))
    return found


def channel_rule(choice: str, format_name: str, state: Mapping[str, Any], network: Any) -> str:
    """``"sum"`` or ``"fold"``: ``choice`` (``init_channels``) resolved for this checkpoint and
    the recipe's ``network``; an explicit ``"fold"`` that cannot apply is refused in one line."""
    if choice not in CHANNEL_RULES:
        raise UserError(f"model.init_channels = {choice!r}: choose one of {', '.join(CHANNEL_RULES)}")
    family = FAMILIES.get(format_name)
    kernels = _kernels(state)
    rgb = bool(kernels) and kernels[0][1][kernels[0][2]].shape[1] == 3
    if choice == "auto":
        return "fold" if family is not None and rgb and not network.standardise_input else "sum"
    if choice == "sum":
        return "sum"
    if family is None:
        raise UserError(f"model.init_channels = \"fold\": octfw does not know the input normalisation of "
                        f"{format_name!r} weights; use \"sum\"")
    if not rgb:
        raise UserError("model.init_channels = \"fold\": the checkpoint's patch projection does not take RGB "
                        "(3 channels), there is no colour normalisation to fold; use \"sum\"")
    if network.standardise_input:
        raise UserError(f"model.init_channels = \"fold\" folds {family.name}'s normalisation of [0, 1] intensities "
                        "into the patch projection, but model.standardise_input = true standardises each volume "
                        "first: set model.standardise_input = false (or init_channels = \"sum\")")
    return "fold"


def fold_checkpoint(state: Mapping[str, Any], normalisation: Normalisation) -> tuple[dict[str, Any], list[str]]:
    """``state`` with every RGB patch projection (kernel and bias) folded with ``normalisation``
    (the checkpoint's other tensors shared, not copied), and the kernels' paths."""
    out = _copied(state)
    folded = []
    for path, holder, key in _kernels(out):
        weight = holder[key]
        if weight.ndim < 4 or weight.shape[1] != 3:
            continue
        bias_key = key[: -len("weight")] + "bias"
        if bias_key not in holder:
            raise UserError(f"model.init: the checkpoint's {path} has no bias to fold the input normalisation "
                            "into; use model.init_channels = \"sum\"")
        holder[key], holder[bias_key] = fold_normalisation(weight, holder[bias_key], normalisation.mean,
                                                           normalisation.std)
        folded.append(path)
    return out, folded


def _copied(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _copied(value) if isinstance(value, Mapping) else value for key, value in state.items()}


def note_fold(report: InitReport, normalisation: Normalisation) -> None:
    """Name the fold in the report, on every patch projection key the converter took."""
    kernel = f"{normalisation.name} normalisation folded in (W_c / std_c)"
    bias = f"{normalisation.name} normalisation folded in (b - sum_c mean_c / std_c * sum W_c)"
    for key in [k for k in report.loaded if k.endswith(("patch_embed.proj.weight", "patch_embed.proj.bias"))]:
        report.loaded.remove(key)
        report.adapted[key] = ""
    for key, how in list(report.adapted.items()):
        if key.endswith("patch_embed.proj.weight"):
            report.adapted[key] = "; ".join(h for h in (kernel, how) if h)
        elif key.endswith("patch_embed.proj.bias"):
            report.adapted[key] = "; ".join(h for h in (bias, how) if h)


def input_note(format_name: str, rule: str, state: Mapping[str, Any], network: Any) -> str | None:
    """One line when the recipe's input is not the one the published model was trained on
    (RGB weights of a known family, taken by the sum rule); None when it is, or is unknown."""
    family = FAMILIES.get(format_name)
    kernels = _kernels(state)
    if family is None or rule == "fold" or not kernels or kernels[0][1][kernels[0][2]].shape[1] != 3:
        return None
    recipe = ("standardises each volume (standardise_input = true)" if network.standardise_input
              else "takes the intensities as they come (standardise_input = false, init_channels = \"sum\")")
    return (f"input: {family.name} was trained on {family.normalisation.describe()}; the recipe {recipe}, so its "
            "tokens are not the published model's for the same image (init_channels = \"fold\" with "
            "standardise_input = false gives them from [0, 1] intensities)")


def refuse_heads(format_name: str, network: Any) -> None:
    """UserError in one line when ``network``'s head count cannot be that of the source's published
    encoder of its width (the checkpoint fits the recipe's width by then)."""
    family = FAMILIES.get(format_name)
    heads = None if family is None else family.heads.get(network.embed_dim)
    if heads is None or network.num_heads == heads:
        return
    raise UserError(f"model.init: model.num_heads = {network.num_heads}, but {family.name}'s published "
                    f"{network.embed_dim}-wide encoders have {heads} attention heads (a checkpoint does not record "
                    f"them): set model.num_heads = {heads}")
