"""Converter of V-JEPA 2 checkpoints (facebookresearch/vjepa2) into octfw's 3D ViT.

The format, as its training loop saves it and ``src/hub/backbones.py`` reads it: a dict
with ``encoder`` and ``predictor`` (and ``target_encoder`` in training checkpoints), each a
state dict whose keys start with ``module.backbone.`` (DDP, then the multi-sequence
wrapper). The encoder's own names are octfw's (``patch_embed.proj``, ``blocks.N.norm1``,
``attn.qkv``, ``attn.proj``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``, ``norm``); the
predictor's are prefixed (``predictor_embed``, ``mask_tokens.N``, ``predictor_blocks``,
``predictor_norm``, ``predictor_proj``) and map to octfw's ``embed_in``, ``mask_token``,
``blocks``, ``norm`` and ``embed_out``. A flat safetensors file of the same keys with the
group as first part (``encoder.module.backbone.blocks.0...``) is read the same way.

What is adapted, and why:

- ``patch_embed.proj.weight``: RGB to one channel (the sum of the channel kernels: a grey
  volume gives the tokens the RGB network gives for it repeated in three channels), and
  the 2-frame tubelet x 16 x 16 to the recipe's patch (I3D-style, :func:`~octfw.models.published.adapt.inflate_kernel`).
- positions: V-JEPA 2 trains with 3D rotary embeddings (``use_rope``), which have no
  weights and fit any grid, so a ``position = "rope"`` recipe needs nothing; the
  ``pos_embed`` tables its checkpoints still carry are ignored, as its own hub loader
  ignores them. A ``"learned"`` recipe resamples such a table (V-JEPA 1-style
  checkpoints trained with it) to its grid; a ``"sincos"`` recipe is refused.
- ``mask_tokens``: the reference builds as many as mask configurations times clip lengths
  (10 in its published predictor), but its train step picks one by clip length, not by mask
  configuration (``PredictorMultiSeqWrapper`` passes the clip length's place as
  ``mask_index``): every mask configuration of one clip length shares a token. octfw's
  volumes are one clip length, so its one mask token, used by every mask configuration, is
  ``mask_tokens.0``; the others are ignored, each named in the report
  (tests/test_published_weights.py holds both configurations to the reference's train step).

Attention heads are not in a checkpoint: the recipe's preset gives them (V-JEPA 2's ViT-L
has 16, its published ViT-g 22, the ``giant`` preset), and rotary positions depend on them.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from octfw.display.errors import UserError
from octfw.models.published.adapt import (adapt_channels, encoder_shape, inflate_kernel, load_into,
                                          refuse_misfit, resample_positions)
from octfw.models.published.report import InitReport

__all__ = ["NAME", "GROUPS", "REFERENCE_NORM_EPS", "FIRST_TOKEN", "OTHER_TOKENS", "detect", "groups", "convert",
           "predictor_state"]

NAME = "vjepa2"
GROUPS = ("encoder", "target_encoder", "predictor")
#: The LayerNorm epsilon of V-JEPA 2's networks (``partial(nn.LayerNorm, eps=1e-6)``).
REFERENCE_NORM_EPS = 1e-6
#: The report's words for the mask tokens: the reference's train step picks one by clip length.
FIRST_TOKEN = ("mask_tokens.0 (the reference's token for one clip length, every mask configuration's), "
               "[1, 1, W] to [W]")
OTHER_TOKENS = "a mask token for another clip length (the reference picks them by clip length, octfw has one)"
#: Frames / tubelet of V-JEPA's pretraining clips: the depth of a position table's grid.
_TABLE_DEPTHS = (8, 32, 1)


def _strip(key: str) -> str:
    while key.startswith(("module.", "backbone.")):
        key = key.split(".", 1)[1]
    return key


def groups(state: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's state dicts by group, prefixes stripped (nested or flat files)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in GROUPS:
        if isinstance(state.get(name), Mapping):
            out[name] = {_strip(k): v for k, v in state[name].items() if isinstance(v, torch.Tensor)}
    if out:
        return out
    for key, value in state.items():
        group, _, rest = key.partition(".")
        if group in GROUPS and rest and isinstance(value, torch.Tensor):
            out.setdefault(group, {})[_strip(rest)] = value
    return out


def detect(state: Mapping[str, Any]) -> bool:
    encoder = groups(state).get("encoder", {})
    # V-JEPA 2.1's encoders (norms of their hierarchical outputs) have their own converter, and so
    # has VideoMAE, whose pretraining state saved flat also reads as an "encoder" group (q_bias/v_bias).
    return ("patch_embed.proj.weight" in encoder and "norms_block.0.weight" not in encoder
            and "blocks.0.attn.q_bias" not in encoder)


def convert(state: Mapping[str, Any], targets: Any, report: InitReport) -> None:
    """Copy the checkpoint's encoders (and predictor) into ``targets``, noting each key."""
    parts = groups(state)
    encoder, target = parts["encoder"], parts.get("target_encoder")
    if targets.ema is None:  # one encoder: the EMA one V-JEPA evaluates, where there is one
        roles = [("online", targets.online, target or encoder, "target_encoder" if target else "encoder")]
    else:
        roles = [("online", targets.online, encoder, "encoder"),
                 ("ema", targets.ema, target or encoder, "target_encoder" if target else "encoder")]
        if target is None:
            report.notes.append("the checkpoint has no target_encoder: the EMA encoder starts from its encoder")
    for role, network, source, name in roles:
        _encoder(network, source, name, targets.prefixes[role], targets.recipe, report)
    first = targets.online
    if first.norm_eps != REFERENCE_NORM_EPS:
        report.notes.append(f"model.norm_eps = {first.norm_eps:g}, V-JEPA 2 trained with {REFERENCE_NORM_EPS:g}: "
                            "set it to compute what the reference computes")
    if first.rope_span is not None:
        report.notes.append(f"model.rope_span = {first.rope_span}, V-JEPA 2 does not stretch its positions: "
                            "leave it unset to compute what the reference computes")
    report.notes.append(f"{first.num_heads} attention heads, from the recipe (a checkpoint does not record them)")
    _predictor(parts.get("predictor"), targets, first, report)


def _encoder(network: Any, source: Mapping[str, torch.Tensor], name: str, prefix: str, recipe: str,
             report: InitReport) -> None:
    shape = encoder_shape(source)
    refuse_misfit(f"the checkpoint's {name}", shape, network.embed_dim, network.depth,
                  network.blocks[0].mlp.fc1.out_features, recipe)
    if network.position not in ("rope", "learned"):
        raise UserError(f"model.init: model.position = {network.position!r} but V-JEPA 2 weights are trained with "
                        "its rotary positions: set model.position = \"rope\" (or \"learned\" for a checkpoint "
                        "with a trained table)")
    state: dict[str, torch.Tensor] = {}
    for key, tensor in source.items():
        if key == "pos_embed":
            if network.position == "rope":
                report.ignored[f"{name}.pos_embed"] = "a position table; the recipe uses rotary positions, as V-JEPA 2 does"
                continue
            table, how = resample_positions(tensor, _table_grid(tensor, network.grid_size, name), network.grid_size)
            state[key] = table
            report.took(prefix + key, how)
            continue
        if key == "patch_embed.proj.weight":
            kernel, channels = adapt_channels(tensor, network.in_channels)
            kernel, inflated = inflate_kernel(kernel, network.patch_size)
            how = "; ".join(h for h in (channels, inflated) if h)
            state[key] = kernel
            report.took(prefix + key, how)
            continue
        state[key] = tensor
        report.loaded.append(prefix + key)
    load_into(network, state, f"the checkpoint's {name}")
    for key in network.state_dict():
        if key not in state:
            report.new[prefix + key] = f"not in the checkpoint's {name}"


def _table_grid(table: torch.Tensor, grid: tuple[int, int, int], name: str) -> tuple[int, int, int]:
    """The grid of a ``[1, N, E]`` table: the recipe's when N fits, else (d, g, g) with a
    square in-plane grid and d one of V-JEPA's clip depths."""
    tokens = table.shape[1]
    if tokens == grid[0] * grid[1] * grid[2]:
        return grid
    for depth in _TABLE_DEPTHS:
        side = round((tokens / depth) ** 0.5)
        if depth * side * side == tokens:
            return depth, side, side
    raise UserError(f"model.init: the checkpoint's {name}.pos_embed has {tokens} rows: not a grid octfw can tell "
                    f"(8 x g x g or g x g); use model.position = \"rope\"")


def predictor_state(source: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference predictor's tensors under octfw's :class:`MaskedTokenDecoder` names
    (position tables and the mask tokens after the first left out)."""
    names = {"predictor_embed.": "embed_in.", "predictor_blocks.": "blocks.", "predictor_norm.": "norm.",
             "predictor_proj.": "embed_out."}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in source.items():
        for old, new in names.items():
            if key.startswith(old):
                out[new + key[len(old):]] = tensor
        if key == "mask_tokens.0":
            out["mask_token"] = tensor.reshape(-1)
    return out


def _predictor(source: Mapping[str, torch.Tensor] | None, targets: Any, encoder: Any, report: InitReport) -> None:
    network, prefix = targets.predictor, targets.prefixes.get("predictor", "predictor.")
    if network is None:
        if source is not None:
            report.ignored["predictor"] = targets.predictor_note or "the recipe does not continue the predictor"
        return
    reason = None
    if source is None:
        reason = "the checkpoint has no predictor"
    else:
        shape = encoder_shape(source, "predictor_blocks")
        ours = (network.embed_in.out_features, len(network.blocks), network.blocks[0].mlp.fc1.out_features)
        theirs = (source["predictor_embed.weight"].shape[0], shape["depth"], shape["mlp"])
        if ours != theirs:
            reason = (f"the checkpoint's predictor is {theirs[0]} wide, {theirs[1]} deep (MLP {theirs[2]}), "
                      f"the recipe's {ours[0]} wide, {ours[1]} deep (MLP {ours[2]})")
        elif network.embed_out.out_features != source["predictor_proj.weight"].shape[0]:
            reason = (f"the recipe's predictor predicts {network.embed_out.out_features} channels "
                      f"(dense_levels), the checkpoint's {source['predictor_proj.weight'].shape[0]}")
        elif network.position != "rope":
            reason = f"the recipe's predictor uses {network.position!r} positions, V-JEPA 2's are 'rope'"
    if reason is not None:
        for key in network.state_dict():
            report.new[prefix + key] = reason
        return
    state = predictor_state(source)
    load_into(network, state, "the checkpoint's predictor")
    for key in state:
        if key == "mask_token":
            report.adapted[prefix + key] = FIRST_TOKEN
        else:
            report.loaded.append(prefix + key)
    for key in source:
        if re.fullmatch(r"mask_tokens\.[1-9]\d*", key):
            report.ignored[f"predictor.{key}"] = OTHER_TOKENS
        elif key == "predictor_pos_embed":
            report.ignored[f"predictor.{key}"] = "a position table; the recipe uses rotary positions"
    for key in network.state_dict():
        if key not in state:
            report.new[prefix + key] = "not in the checkpoint's predictor"
