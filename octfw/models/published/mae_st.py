"""Converter of MAE-ST checkpoints (facebookresearch/mae_st, "Masked Autoencoders As
Spatiotemporal Learners") into octfw's 3D ViT.

The format: a dict with ``model_state`` (the published files, as ``main_finetune.py`` reads
them) or ``model`` (what ``util/misc.save_model`` writes), holding the state dict of
``models_mae.MaskedAutoencoderViT`` (pretraining) or ``models_vit.VisionTransformer``
(fine-tuned). Its names are octfw's (``patch_embed.proj``, ``blocks.N.norm1``, ``attn.proj``,
``norm2``, ``mlp.fc1``, ``mlp.fc2``, ``norm``) except:

- ``blocks.N.attn.q``, ``.k``, ``.v``: three projections (``util/video_vit.Attention``);
  their weights and biases are stacked into octfw's ``attn.qkv`` (zero biases where the
  checkpoint was trained with ``no_qkv_bias``).
- positions: with ``sep_pos_embed`` (its pretraining default) a spatial table
  ``pos_embed_spatial`` [1, g*g, E] and a temporal one ``pos_embed_temporal`` [1, T, E], added
  as the reference adds them (spatial repeated over time plus temporal repeated over space)
  into one [1, T*g*g, E] table; else ``pos_embed`` (its cls row dropped). The table is then
  resampled to the recipe's grid (trilinear; for a separable table that is the spatial table
  resampled bilinearly plus the temporal one linearly) and trains as octfw's ``"learned"`` one.
- the cls token (``cls_embed``, its pretraining default) is dropped with ``pos_embed_class``:
  octfw's encoder returns patch tokens only and its evaluations pool them. The reference's
  patch tokens attended to the cls token, so they are not octfw's for the same input (the
  fixture measures by how much); its network built without the cls token computes exactly
  octfw's.
- ``decoder_*``, ``mask_token`` (the pixel decoder) and ``head`` (a fine-tuned class head) are
  ignored. A fine-tuned network applies its ``norm`` to the pooled token, octfw to every token.
- ``patch_embed.proj.weight``: RGB to one channel and its ``t_patch_size`` x 16 x 16 kernel
  to the recipe's patch (:mod:`octfw.models.published.adapt`).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from octfw.models.published.mae_common import load_encoder, merged_qkv, resampled, table_grid, unwrap
from octfw.models.published.report import InitReport

__all__ = ["NAME", "detect", "convert"]

NAME = "mae-st"
_GROUPS = ("model_state", "model")
_CLS = "octfw has no cls token: its encoder returns the patch tokens, which its evaluations pool"


def detect(state: Mapping[str, Any]) -> bool:
    inner = unwrap(state, _GROUPS)
    kernel = inner.get("patch_embed.proj.weight")
    return "blocks.0.attn.q.weight" in inner and kernel is not None and kernel.ndim == 5


def convert(state: Mapping[str, Any], targets: Any, report: InitReport) -> None:
    """Copy the checkpoint's encoder into ``targets`` (and its EMA encoder), noting each key."""
    inner = unwrap(state, _GROUPS)
    source: dict[str, torch.Tensor] = {}
    adapted: dict[str, str] = {}
    for key, tensor in inner.items():
        if key in ("cls_token", "pos_embed_class"):
            report.ignored[key] = _CLS
        elif key.startswith(("decoder_", "mask_token")):
            report.ignored[key] = "the pretraining decoder (octfw's pixel decoder starts new)"
        elif key.startswith("head."):
            report.ignored[key] = "the fine-tuned class head"
        elif not re.match(r"^(blocks\.\d+\.attn\.[qkv]\.|pos_embed)", key):
            source[key] = tensor
    blocks = sorted({int(m.group(1)) for k in inner if (m := re.match(r"^blocks\.(\d+)\.", k))})
    for index in blocks:
        attn = f"blocks.{index}.attn."
        source[attn + "qkv.weight"] = torch.cat([inner[f"{attn}{p}.weight"] for p in "qkv"])
        adapted[attn + "qkv.weight"] = "attn.q, attn.k and attn.v stacked"
        if f"{attn}q.bias" in inner:
            source[attn + "qkv.bias"] = merged_qkv(*(inner[f"{attn}{p}.bias"] for p in "qkv"))
            adapted[attn + "qkv.bias"] = "attn.q, attn.k and attn.v biases stacked"
        else:
            source[attn + "qkv.bias"] = torch.zeros(source[attn + "qkv.weight"].shape[0])
            adapted[attn + "qkv.bias"] = "zero (the checkpoint was trained with no_qkv_bias)"
    has_cls = "cls_token" in inner

    def table(network: Any) -> tuple[torch.Tensor, str | None]:
        if "pos_embed_spatial" in inner:
            spatial, temporal = inner["pos_embed_spatial"], inner["pos_embed_temporal"]
            side = round(spatial.shape[1] ** 0.5)
            depth = temporal.shape[1]
            summed = spatial.repeat(1, depth, 1) + temporal.repeat_interleave(spatial.shape[1], dim=1)
            made = (f"pos_embed_spatial ({side} x {side}) and pos_embed_temporal ({depth}) added into one "
                    "table, as the reference adds them")
            return resampled(summed, (depth, side, side), network, made)
        full = inner["pos_embed"]
        rows = full[:, 1:] if has_cls else full
        grid = table_grid(rows.shape[1], network.grid_size, "the checkpoint's pos_embed")
        return resampled(rows, grid, network, "pos_embed without its cls row" if has_cls else None)

    load_encoder(targets, source, table, adapted, report, "network", "MAE-ST")
    if has_cls:
        report.notes.append("the cls token is dropped (octfw pools patch tokens); the reference's patch tokens "
                            "attended to it, so octfw's are those of the reference built without it")
