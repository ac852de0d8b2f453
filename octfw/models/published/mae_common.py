"""What the MAE-family converters (VideoMAE, MAE-ST, RETFound) share: unwrapping a
training checkpoint's state dict, assembling one ``qkv`` projection, folding layer scales
into the projections they scale, and loading a ViT encoder stated in octfw's names into
the recipe's encoder(s) with its patch kernel and position table adapted.

A converter renames its source's keys to octfw's (``patch_embed.proj``, ``blocks.N.norm1``,
``attn.qkv``, ``attn.proj``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``, ``norm``) and hands the
result to :func:`load_encoder` with its position table (or how to make one) and what it
already adapted; every key lands in the report as loaded, adapted (with how) or left new.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from octfw.display.errors import UserError
from octfw.models.published.adapt import (adapt_channels, encoder_shape, inflate_kernel, load_into,
                                          refuse_misfit, resample_positions)
from octfw.models.published.report import InitReport

__all__ = ["REFERENCE_NORM_EPS", "unwrap", "merged_qkv", "fold_layer_scale", "table_grid", "load_encoder", "resampled"]

#: The LayerNorm epsilon of VideoMAE's, MAE-ST's and RETFound's ViTs (``partial(nn.LayerNorm, eps=1e-6)``).
REFERENCE_NORM_EPS = 1e-6

#: Token-grid depths of the sources' pretraining clips (16 frames / tubelet 2, 32 / 4, ...) tried
#: when a table's grid is not the recipe's.
_TABLE_DEPTHS = (8, 16, 4, 2, 1)

#: A position table and how it was made from the checkpoint (None: loaded as it is).
Table = tuple[torch.Tensor, "str | None"]


def unwrap(state: Mapping[str, Any], groups: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of the first of ``groups`` that ``state`` holds as a dict (``model``,
    ``module``, ``model_state``, ...), else of ``state`` itself (a flat file), with DDP's
    ``module.`` prefix removed."""
    inner = next((state[g] for g in groups if isinstance(state.get(g), Mapping)), state)
    out: dict[str, torch.Tensor] = {}
    for key, value in inner.items():
        if isinstance(value, torch.Tensor):
            out[key[len("module."):] if key.startswith("module.") else key] = value
    return out


def merged_qkv(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    """One ``qkv`` weight or bias from the query's, key's and value's (a missing key bias is zero)."""
    return torch.cat([q, torch.zeros_like(q) if k is None else k, v], dim=0)


def fold_layer_scale(weight: torch.Tensor, bias: torch.Tensor,
                     gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gamma * (W x + b)`` as one linear layer: ``(gamma W) x + gamma b``, the same output."""
    return weight * gamma[:, None], bias * gamma


def table_grid(rows: int, grid: tuple[int, int, int], what: str) -> tuple[int, int, int]:
    """The grid of a position table of ``rows`` rows: the recipe's ``grid`` when it fits, else
    ``(d, g, g)``: a square in-plane grid and d one of the sources' clip depths."""
    if rows == grid[0] * grid[1] * grid[2]:
        return grid
    for depth in _TABLE_DEPTHS:
        side = round((rows / depth) ** 0.5)
        if depth * side * side == rows:
            return depth, side, side
    raise UserError(f"model.init: {what} has {rows} rows: not a grid octfw can tell (d x g x g with d one of "
                    f"{', '.join(map(str, _TABLE_DEPTHS))})")


def load_encoder(targets: Any, source: Mapping[str, torch.Tensor], table: Callable[[Any], Table],
                 adapted: Mapping[str, str], report: InitReport, name: str, family: str) -> None:
    """Load ``source`` (an encoder's state in octfw's names, its patch kernel as the checkpoint
    has it, no position table) into the recipe's encoder and, where there is one, its EMA
    encoder (the same weights: MAE-family checkpoints have one encoder).

    ``table(network)``: the position table for that network's grid and how it was made.
    ``adapted``: keys the converter already changed (merged, folded), with how. ``name``: the
    checkpoint's group in messages; ``family``: the source's name in messages."""
    roles = [("online", targets.online)] + ([("ema", targets.ema)] if targets.ema is not None else [])
    for role, network in roles:
        _encoder(network, source, table, adapted, report, name, targets.prefixes.get(role, ""), targets.recipe,
                 family)
    first = targets.online
    if first.norm_eps != REFERENCE_NORM_EPS:
        report.notes.append(f"model.norm_eps = {first.norm_eps:g}, {family} trained with {REFERENCE_NORM_EPS:g}: "
                            "set it to compute what the reference computes")
    report.notes.append(f"{first.num_heads} attention heads, from the recipe (a checkpoint does not record them)")
    if targets.predictor is not None:
        prefix = targets.prefixes.get("predictor", "predictor.")
        for key in targets.predictor.state_dict():
            report.new[prefix + key] = f"{family} checkpoints carry a pixel decoder, not a V-JEPA predictor"


def _encoder(network: Any, source: Mapping[str, torch.Tensor], table: Callable[[Any], Table],
             adapted: Mapping[str, str], report: InitReport, name: str, prefix: str, recipe: str,
             family: str) -> None:
    refuse_misfit(f"the checkpoint's {name}", encoder_shape(source), network.embed_dim, network.depth,
                  network.blocks[0].mlp.fc1.out_features, recipe)
    if network.position != "learned":
        raise UserError(f"model.init: model.position = {network.position!r} but {family} weights come with a "
                        "position table added to the tokens: set model.position = \"learned\"")
    state = dict(source)
    how = dict(adapted)
    kernel, channels = adapt_channels(state["patch_embed.proj.weight"], network.in_channels)
    kernel, inflated = inflate_kernel(kernel, network.patch_size)
    state["patch_embed.proj.weight"] = kernel
    if channels or inflated:
        how["patch_embed.proj.weight"] = "; ".join(h for h in (channels, inflated) if h)
    state["pos_embed"], made = table(network)
    if made:
        how["pos_embed"] = made
    load_into(network, state, f"the checkpoint's {name}")
    for key in state:
        report.took(prefix + key, how.get(key, ""))
    for key in network.state_dict():
        if key not in state:
            report.new[prefix + key] = f"not in the checkpoint's {name}"


def resampled(table: torch.Tensor, grid: tuple[int, int, int], network: Any, made: str | None = None) -> Table:
    """``table`` (``[1, N, E]`` over ``grid``) resampled to ``network``'s grid, with how (``made``
    first: how the table itself was formed from the checkpoint)."""
    out, how = resample_positions(table, grid, network.grid_size)
    return out, "; ".join(h for h in (made, how) if h) or None
