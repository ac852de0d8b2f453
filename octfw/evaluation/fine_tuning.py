"""What an evaluator that trains the encoder needs: the encoder, what of it trains, its learning rates.

``fine-tune``, ``dense-probe`` and ``layer-segmentation`` train the target
encoder further (or its last blocks) under a head of their own; these are the
parts they share, in the core, so that a third-party evaluator uses them as
the built-in ones do (no plugin imports another: pyproject.toml's import
contracts):

- :func:`encoder_to_fine_tune`: the encoder of the model an evaluator is given,
  one that runs block by block (:class:`~octfw.types.BlockwiseEncoder`);
- ``blocks``: :data:`ALL_BLOCKS` trains the whole encoder, patch embedding
  included; an int ``k`` only the last ``k`` blocks and the final norm
  (:func:`first_trained_block`, :func:`unfreeze_trained_part`);
- AdamW with layer-wise learning-rate decay (BEiT, RETFound:
  :func:`parameter_groups`): block ``i`` (0-based) of ``L`` gets
  ``lr x layer_decay ** (L - i)``, the patch embedding
  ``lr x layer_decay ** (L + 1)``, the final norm and the head ``lr``: layers
  near the input, which transfer best, move least. No weight decay on 1-D
  parameters (biases, norm scales).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from octfw.display.errors import UserError
from octfw.evaluation.attentive import decayed
from octfw.types import BlockwiseEncoder, EncoderModel, missing_members

# The encoder is any :class:`octfw.types.BlockwiseEncoder` (the built-in 3D ViT): evaluation
# sits below the plugins and may not import a model package (the layers, pyproject.toml),
# and the encoder's own input step (standardising, positions) must run.

__all__ = ["ALL_BLOCKS", "encoder_to_fine_tune", "first_trained_block", "unfreeze_trained_part", "layer_exponent",
           "parameter_groups"]

#: ``blocks`` value that trains the whole encoder, patch embedding included.
ALL_BLOCKS = "all"


def encoder_to_fine_tune(model: Any, where: str, otherwise: str = "") -> BlockwiseEncoder:
    """The encoder an evaluator fine-tunes: ``model`` itself, or its ``.encoder``
    (:class:`~octfw.types.EncoderModel`); a one-line UserError (ending with ``otherwise``)
    when neither runs block by block (:class:`~octfw.types.BlockwiseEncoder`)."""
    encoder = model.encoder if isinstance(model, EncoderModel) and not isinstance(model, BlockwiseEncoder) else model
    if not isinstance(encoder, BlockwiseEncoder):
        missing = ", ".join(missing_members(encoder, BlockwiseEncoder))
        raise UserError(f"{where}: fine-tunes an encoder that runs block by block (octfw.types.BlockwiseEncoder, "
                        f"a model's .encoder); {type(encoder).__name__} lacks {missing}{otherwise}")
    return encoder


def first_trained_block(depth: int, blocks: int | str) -> int:
    """Index of the first block that trains: 0 for ``"all"``, ``depth - k`` for ``k``."""
    return 0 if blocks == ALL_BLOCKS else depth - int(blocks)


def unfreeze_trained_part(encoder: BlockwiseEncoder, blocks: int | str) -> int:
    """Let only what ``blocks`` trains have gradients: the blocks from the first trained one
    on and the final norm, the patch embedding too for ``"all"``; return that first block."""
    start = first_trained_block(len(encoder.blocks), blocks)
    encoder.requires_grad_(False)  # a target encoder arrives frozen; unfreeze what trains
    trained = [encoder.norm, *encoder.blocks[start:]]
    if blocks == ALL_BLOCKS:
        trained.append(encoder.patch_embed)
    for module in trained:
        module.requires_grad_(True)
    return start


def layer_exponent(name: str, depth: int) -> int:
    """``e`` in ``lr x layer_decay ** e`` for the parameter ``name`` of a network that holds
    the encoder as ``encoder`` (the head's and decoder's parameters: 0)."""
    if name.startswith("encoder.patch_embed."):
        return depth + 1
    if name.startswith("encoder.blocks."):
        return depth - int(name.split(".")[2])
    return 0  # the final norm and the head


def parameter_groups(network: nn.Module, lr: float, layer_decay: float,
                     weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups of the trained parameters of ``network`` (a head and the encoder, held as
    ``network.encoder``): one per (layer exponent, decayed or not).

    Each group carries ``lr_scale`` (``layer_decay ** exponent``, which the
    schedule multiplies) and ``exponent``; frozen parameters are in no group.
    """
    depth = len(network.encoder.blocks)
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in network.named_parameters():
        if not param.requires_grad:
            continue
        exponent, decays = layer_exponent(name, depth), decayed(param.shape)
        group = groups.setdefault((exponent, decays), {
            "params": [], "names": [], "exponent": exponent, "lr_scale": layer_decay ** exponent,
            "lr": lr * layer_decay ** exponent, "weight_decay": weight_decay if decays else 0.0})
        group["params"].append(param)
        group["names"].append(name)
    return [groups[key] for key in sorted(groups)]
