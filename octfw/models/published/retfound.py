"""Converter of RETFound checkpoints (rmaphoh/RETFound_MAE, a 2D MAE ViT-L/16 at 224 pixels
in timm's format) into octfw's 3D ViT: the 2D network inflated to volumes.

The format: ``{"model": state_dict}`` (the MAE pretraining checkpoint RETFound publishes;
``main_finetune.py`` reads ``checkpoint['model']``), or a flat state dict (a timm
safetensors file). The same layout is MAE's ImageNet weights' (facebookresearch/mae) and
timm's ViTs': any such 2D ViT converts the same way. Its names are octfw's
(``patch_embed.proj``, ``blocks.N.norm1``, ``attn.qkv``, ``attn.proj``, ``norm2``,
``mlp.fc1``, ``mlp.fc2``, ``norm``). What is adapted, and why:

- ``patch_embed.proj.weight`` [E, 3, 16, 16]: RGB summed to one channel (a grey volume gives
  the tokens the RGB network gives for it repeated in three channels), then inflated I3D
  style: repeated over the recipe's patch depth and divided by it, so that a volume constant
  over depth gives each patch the 2D network's response to its slice
  (:func:`~octfw.models.published.adapt.inflate_kernel`).
- ``pos_embed`` [1, 1 + 196, E]: the cls row dropped, the 14 x 14 table resampled to the
  recipe's in-plane grid (bilinear; MAE's own ``interpolate_pos_embed`` is bicubic) and
  repeated over the grid's depth: every slice of patches has the in-plane positions the 2D
  network knows, and depth has no position of its own until training gives it one (the
  table is octfw's ``"learned"`` one). A depth-constant volume then gives, on every slice,
  the 2D network's patch tokens for that slice (attention over a token repeated d times
  weighs it as once).
- the cls token is dropped: octfw's encoder returns the patch tokens, which its evaluations
  pool (RETFound's fine-tuning pools them too, ``global_pool``). The reference's patch tokens
  attended to the cls token, so they are not octfw's for the same image (the fixture
  measures by how much); timm's ViT built without a class token computes exactly octfw's.
- layer scales (``blocks.N.ls1.gamma``, ``ls2.gamma``, timm ViTs trained with
  ``init_values``) are folded into ``attn.proj`` and ``mlp.fc2`` (the same output).
- ignored: ``mask_token`` and ``decoder_*`` (MAE's pixel decoder: octfw's starts new),
  ``head`` and ``fc_norm`` (a fine-tuned classifier; its ``global_pool`` networks have no
  ``norm``, and octfw's is then left new).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from octfw.display.errors import UserError
from octfw.models.published.adapt import resample_positions
from octfw.models.published.mae_common import fold_layer_scale, load_encoder, unwrap
from octfw.models.published.report import InitReport

__all__ = ["NAME", "detect", "convert", "inflated_table"]

NAME = "retfound"
_GROUPS = ("model", "state_dict")
_CLS = "octfw has no cls token: its encoder returns the patch tokens, which its evaluations pool"


def _inner(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k[len("backbone."):] if k.startswith("backbone.") else k: v for k, v in unwrap(state, _GROUPS).items()}


def detect(state: Mapping[str, Any]) -> bool:
    inner = _inner(state)
    kernel = inner.get("patch_embed.proj.weight")
    return kernel is not None and kernel.ndim == 4 and "blocks.0.attn.qkv.weight" in inner


def inflated_table(table: torch.Tensor, grid: tuple[int, int, int]) -> tuple[torch.Tensor, str | None]:
    """A 2D position table ``[1, g*g, E]`` (square, no cls row) as a 3D one for ``grid``
    ``(d, h, w)``: resampled in-plane to ``h x w`` (bilinear) and repeated over the ``d``
    slices, with how."""
    side = round(table.shape[1] ** 0.5)
    if side * side != table.shape[1]:
        raise UserError(f"model.init: the checkpoint's pos_embed has {table.shape[1]} patch rows, not a square grid")
    plane, _ = resample_positions(table, (1, side, side), (1, *grid[1:]))
    out = plane.reshape(1, 1, grid[1] * grid[2], -1).expand(1, grid[0], -1, -1).reshape(1, -1, table.shape[-1])
    how = [] if (side, side) == tuple(grid[1:]) else [
        f"resampled from {side} x {side} to {grid[1]} x {grid[2]} (bilinear)"]
    if grid[0] > 1:
        how.append(f"repeated over the {grid[0]} slices of the grid")
    return out.contiguous(), "; ".join(how) or None


def convert(state: Mapping[str, Any], targets: Any, report: InitReport) -> None:
    """Copy the checkpoint's 2D encoder, inflated, into ``targets`` (and its EMA encoder)."""
    inner = _inner(state)
    source: dict[str, torch.Tensor] = {}
    adapted: dict[str, str] = {}
    for key, tensor in inner.items():
        if key == "cls_token":
            report.ignored[key] = _CLS
        elif key.startswith(("decoder_", "mask_token")):
            report.ignored[key] = "MAE's pixel decoder (octfw's starts new)"
        elif key.startswith(("head.", "fc_norm.")):
            report.ignored[key] = "the fine-tuned classifier (head, and fc_norm of the pooled token)"
        elif not re.match(r"^(blocks\.\d+\.ls[12]\.gamma|pos_embed)$", key):
            source[key] = tensor
    blocks = sorted({int(m.group(1)) for k in inner if (m := re.match(r"^blocks\.(\d+)\.", k))})
    for index in blocks:
        block = f"blocks.{index}."
        if block + "attn.qkv.bias" not in source:
            source[block + "attn.qkv.bias"] = torch.zeros(source[block + "attn.qkv.weight"].shape[0])
            adapted[block + "attn.qkv.bias"] = "zero (the checkpoint's qkv has no bias)"
        for scale, layer in (("ls1.gamma", "attn.proj"), ("ls2.gamma", "mlp.fc2")):
            if block + scale in inner:
                source[block + layer + ".weight"], source[block + layer + ".bias"] = fold_layer_scale(
                    source[block + layer + ".weight"], source[block + layer + ".bias"], inner[block + scale])
                for part in ("weight", "bias"):
                    adapted[f"{block}{layer}.{part}"] = f"layer scale {scale} folded in (the same output)"
    has_cls = "cls_token" in inner
    patches = inner["pos_embed"][:, 1:] if has_cls else inner["pos_embed"]

    def table(network: Any) -> tuple[torch.Tensor, str | None]:
        out, how = inflated_table(patches, network.grid_size)
        made = "the 2D table without its cls row" if has_cls else "the 2D table"
        return out, f"{made}{'; ' + how if how else ''}" if (has_cls or how) else None

    load_encoder(targets, source, table, adapted, report, "network", "RETFound (MAE)")
    if has_cls:
        report.notes.append("the cls token is dropped (octfw pools patch tokens); the reference's patch tokens "
                            "attended to it, so octfw's are those of timm's ViT built without it")
