"""Converter of V-JEPA 2.1 checkpoints (facebookresearch/vjepa2 ``app/vjepa_2_1``, March 2026)
into octfw's 3D ViT: the encoders, and with ``dense_predictor = "vjepa2.1"`` the predictor and
the level norms (below).

The format is V-JEPA 2's (:mod:`octfw.models.published.vjepa2`: ``module.backbone.``
prefixes), with the EMA encoder saved as ``target_encoder`` or, in the distilled models the
reference's hub loads, ``ema_encoder``. The encoder differs from V-JEPA 2's in four ways,
each handled here:

- rotary positions give each angle to one neighbouring channel pair (the fix V-JEPA 2
  kept out for compatibility) and, with ``interpolate_rope`` as its training configs set
  it, stretch in-plane positions over the 16-patch grid it was trained at: the recipe
  needs ``position = "rope-interleaved"`` (refused otherwise) and ``rope_span = 16``
  (noted otherwise);
- a learned ``video_mod_embed`` is added to every patch token: it is added to the patch
  projection's bias, the same sum for every token (``img_mod_embed`` and the one-frame
  ``patch_embed_img`` serve images and are ignored);
- there is no final ``norm``: the last of ``norms_block`` (one LayerNorm per
  hierarchical output) normalises the output, and becomes octfw's ``norm``; the other
  three normalise the intermediate levels its dense loss predicts, which octfw's encoder
  does not carry: they go into the model's training-only ``level_norms`` (and
  ``target_level_norms`` from the EMA encoder) with ``dense_predictor = "vjepa2.1"``, and
  are ignored, named in the report, otherwise;
- RGB, tubelet and patch adaptations are V-JEPA 2's.

The predictor loads into :class:`~octfw.plugins.models.vjepa3d.hierarchical.HierarchicalPredictor`
(``dense_predictor = "vjepa2.1"``): ``predictor_embed`` (Linear, GELU, Linear from the 4
levels side by side) is ``embed_in``, ``video_mod_embed`` is ``mod_embed``, ``mask_tokens.0``
the mask token (the one the reference uses for one clip length), ``predictor_blocks``,
``predictor_norm``, ``predictor_proj`` and ``predictor_proj_context`` are ``blocks``, ``norm``,
``embed_out`` and ``embed_out_context``; ``img_mod_embed`` and the other mask tokens are
ignored (the train step picks a mask token by clip length, not by mask configuration, as V-JEPA
2's does: :mod:`octfw.models.published.vjepa2`). octfw's own dense predictor (the default) has
none of these, and is left new. So is every predictor where the file's is the distilled ViT-B
and ViT-L files' one-level predictor (one Linear in), which predicts its teacher's (the ViT-G's,
1664 wide) tokens, not the encoder's own: the report says so in one line.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from octfw.display.errors import UserError
from octfw.models.published import vjepa2
from octfw.models.published.adapt import adapt_channels, encoder_shape, inflate_kernel, load_into, refuse_misfit
from octfw.models.published.report import InitReport

__all__ = ["NAME", "REFERENCE_ROPE_SPAN", "detect", "convert"]

NAME = "vjepa2.1"
#: In-plane grid V-JEPA 2.1 stretches its rotary positions over (256-pixel frames, 16-pixel patches).
REFERENCE_ROPE_SPAN = 16
_EMA_GROUPS = ("target_encoder", "ema_encoder")


def _groups(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    out = vjepa2.groups(state)
    if isinstance(state.get("ema_encoder"), Mapping):
        out["ema_encoder"] = {vjepa2._strip(k): v for k, v in state["ema_encoder"].items()
                              if isinstance(v, torch.Tensor)}
    return out


def detect(state: Mapping[str, Any]) -> bool:
    groups = _groups(state)
    return any("norms_block.0.weight" in groups.get(name, {}) for name in ("encoder", *_EMA_GROUPS))


def convert(state: Mapping[str, Any], targets: Any, report: InitReport) -> None:
    groups = _groups(state)
    ema_name = next((name for name in _EMA_GROUPS if name in groups), None)
    online_name = "encoder" if "encoder" in groups else ema_name
    if targets.ema is None:  # one encoder: the EMA one V-JEPA evaluates
        roles = [("online", targets.online, ema_name or online_name)]
    else:
        roles = [("online", targets.online, online_name), ("ema", targets.ema, ema_name or online_name)]
        if ema_name is None:
            report.notes.append("the checkpoint has no EMA encoder: the EMA encoder starts from its encoder")
    norms = targets.level_norms or {}
    for role, network, name in roles:
        _encoder(network, groups[name], name, targets.prefixes[role], targets.recipe, report,
                 norms.get(role), targets.prefixes.get(f"{role}_levels", f"{role}_level_norms."))
    first = targets.online
    if first.rope_span != REFERENCE_ROPE_SPAN:
        report.notes.append(f"model.rope_span = {first.rope_span}, V-JEPA 2.1 stretched in-plane positions over "
                            f"{REFERENCE_ROPE_SPAN} (interpolate_rope): set it to compute what the reference computes")
    if first.norm_eps != vjepa2.REFERENCE_NORM_EPS:
        report.notes.append(f"model.norm_eps = {first.norm_eps:g}, V-JEPA 2.1 trained with "
                            f"{vjepa2.REFERENCE_NORM_EPS:g}: set it to compute what the reference computes")
    report.notes.append(f"{first.num_heads} attention heads, from the recipe (a checkpoint does not record them)")
    if targets.predictor is not None and targets.predictor_format == NAME:
        _predictor(groups.get("predictor"), targets, report)
        return
    reason = _one_level(groups.get("predictor"), first.embed_dim) or (
        "V-JEPA 2.1's predictor reads the encoder's 4 levels concatenated and has separate context and "
        "target heads; octfw's has neither (model.dense_predictor = \"vjepa2.1\" has)")
    if targets.predictor is not None:
        for key in targets.predictor.state_dict():
            report.new[targets.prefixes.get("predictor", "predictor.") + key] = reason
    if "predictor" in groups:
        report.ignored["predictor"] = reason if targets.predictor is not None else (
            targets.predictor_note or "the recipe does not continue the predictor")


#: V-JEPA 2.1's predictor names and octfw's (HierarchicalPredictor).
_PREDICTOR_NAMES = {"predictor_embed.": "embed_in.", "predictor_blocks.": "blocks.", "predictor_norm.": "norm.",
                    "predictor_proj.": "embed_out.", "predictor_proj_context.": "embed_out_context."}


def _one_level(source: Mapping[str, torch.Tensor] | None, embed_dim: int) -> str | None:
    """Why a one-level predictor (one Linear in: the distilled ViT-B and ViT-L files') is left new;
    None for another predictor."""
    if source is None or "predictor_embed.weight" not in source or "predictor_proj.weight" not in source:
        return None
    width = source["predictor_proj.weight"].shape[0]
    if width != embed_dim:
        return (f"the checkpoint's predictor is the one its encoder was distilled with, predicting the teacher's "
                f"{width}-wide tokens rather than this {embed_dim}-wide encoder's own, so a new one is trained")
    return ("the checkpoint's predictor reads the encoder's last level only, and octfw continues only V-JEPA 2.1's "
            "four-level predictor, so a new one is trained")


def _predictor(source: Mapping[str, torch.Tensor] | None, targets: Any, report: InitReport) -> None:
    network, prefix = targets.predictor, targets.prefixes.get("predictor", "predictor.")
    reason = None
    if source is None:
        reason = "the checkpoint has no predictor"
    elif (one_level := _one_level(source, targets.online.embed_dim)) is not None:
        reason = one_level
    elif "predictor_proj_context.weight" not in source:
        reason = "the checkpoint's predictor has no context head (trained without predict_all)"
    else:
        shape = encoder_shape(source, "predictor_blocks")
        ours = (network.embed_in[0].in_features, network.embed_in[2].out_features, len(network.blocks),
                network.blocks[0].mlp.fc1.out_features, network.embed_out.out_features)
        theirs = (source["predictor_embed.0.weight"].shape[1] if "predictor_embed.0.weight" in source else None,
                  source["predictor_embed.2.weight"].shape[0] if "predictor_embed.2.weight" in source else None,
                  shape["depth"], shape["mlp"], source["predictor_proj.weight"].shape[0])
        if ours != theirs:
            reason = (f"the checkpoint's predictor reads {theirs[0]} channels, is {theirs[1]} wide, {theirs[2]} deep "
                      f"(MLP {theirs[3]}) and predicts {theirs[4]}; the recipe's reads {ours[0]}, is {ours[1]} wide, "
                      f"{ours[2]} deep (MLP {ours[3]}) and predicts {ours[4]}")
        elif network.position != "rope-interleaved":
            reason = f"the recipe's predictor uses {network.position!r} positions, V-JEPA 2.1's are 'rope-interleaved'"
    if reason is not None:
        for key in network.state_dict():
            report.new[prefix + key] = reason
        report.ignored["predictor"] = reason
        return
    state: dict[str, torch.Tensor] = {}
    for key, tensor in source.items():
        old = next((old for old in _PREDICTOR_NAMES if key.startswith(old)), None)
        if old is not None:
            state[_PREDICTOR_NAMES[old] + key[len(old):]] = tensor
            report.loaded.append(prefix + _PREDICTOR_NAMES[old] + key[len(old):])
        elif key == "mask_tokens.0":
            state["mask_token"] = tensor.reshape(-1)
            report.adapted[prefix + "mask_token"] = vjepa2.FIRST_TOKEN
        elif key == "video_mod_embed":
            state["mod_embed"] = tensor.reshape(-1)
            report.adapted[prefix + "mod_embed"] = "video_mod_embed (added to every token), [1, 1, W] to [W]"
        elif re.fullmatch(r"mask_tokens\.[1-9]\d*", key):
            report.ignored[f"predictor.{key}"] = vjepa2.OTHER_TOKENS
        elif key == "img_mod_embed":
            report.ignored[f"predictor.{key}"] = "for images (one frame), not volumes"
        else:
            report.ignored[f"predictor.{key}"] = "no place in octfw's V-JEPA 2.1 predictor"
    load_into(network, state, "the checkpoint's predictor")
    for key in network.state_dict():
        if key not in state:
            report.new[prefix + key] = "not in the checkpoint's predictor"


def _encoder(network: Any, source: Mapping[str, torch.Tensor], name: str, prefix: str, recipe: str,
             report: InitReport, level_norms: Any = None, levels_prefix: str = "") -> None:
    levels = sorted(int(k.split(".")[1]) for k in source if k.startswith("norms_block.") and k.endswith(".weight"))
    refuse_misfit(f"the checkpoint's {name}", encoder_shape(source), network.embed_dim, network.depth,
                  network.blocks[0].mlp.fc1.out_features, recipe)
    if network.position != "rope-interleaved":
        raise UserError(f"model.init: model.position = {network.position!r} but V-JEPA 2.1 weights are trained with "
                        "its rotary positions: set model.position = \"rope-interleaved\" and model.rope_span = 16")
    last = f"norms_block.{levels[-1]}."
    if level_norms is not None and len(levels) != len(level_norms) + 1:
        raise UserError(f"model.init: the checkpoint's {name} has {len(levels)} level norms (norms_block) where "
                        f"the recipe's V-JEPA 2.1 dense loss has {len(level_norms) + 1} levels")
    state: dict[str, torch.Tensor] = {}
    norms_state: dict[str, torch.Tensor] = {}
    for key, tensor in source.items():
        if key.startswith(last):
            state["norm." + key[len(last):]] = tensor
            report.adapted[f"{prefix}norm.{key[len(last):]}"] = f"{key}: the last hierarchical output's norm"
        elif key.startswith("norms_block.") and level_norms is not None:
            norms_state[key[len("norms_block."):]] = tensor
            report.loaded.append(levels_prefix + key[len("norms_block."):])
        elif key.startswith("norms_block."):
            report.ignored[f"{name}.{key}"] = "a norm of the intermediate levels V-JEPA 2.1's dense loss predicts"
        elif key.startswith(("patch_embed_img.", "img_mod_embed")):
            report.ignored[f"{name}.{key}"] = "for images (one frame), not volumes"
        elif key == "video_mod_embed":
            continue  # added to the patch projection's bias below
        elif key == "pos_embed":
            report.ignored[f"{name}.pos_embed"] = "a position table; V-JEPA 2.1 uses rotary positions"
        elif key == "patch_embed.proj.weight":
            kernel, channels = adapt_channels(tensor, network.in_channels)
            kernel, inflated = inflate_kernel(kernel, network.patch_size)
            state[key] = kernel
            how = "; ".join(h for h in (channels, inflated) if h)
            report.took(prefix + key, how)
        elif key == "patch_embed.proj.bias" and "video_mod_embed" in source:
            state[key] = tensor + source["video_mod_embed"].reshape(-1)
            report.adapted[prefix + key] = "video_mod_embed added (V-JEPA 2.1 adds it to every patch token)"
        else:
            state[key] = tensor
            report.loaded.append(prefix + key)
    load_into(network, state, f"the checkpoint's {name}")
    for key in network.state_dict():
        if key not in state:
            report.new[prefix + key] = f"not in the checkpoint's {name}"
    if level_norms is not None:
        load_into(level_norms, norms_state, f"the checkpoint's {name} level norms")
        for key in level_norms.state_dict():
            if key not in norms_state:
                report.new[levels_prefix + key] = f"not in the checkpoint's {name}"
