"""Converter of VideoMAE checkpoints (MCG-NJU/VideoMAE, and the same networks under Hugging
Face transformers' names) into octfw's 3D ViT.

The format, as ``utils.save_model`` writes it and ``run_class_finetuning.py`` reads it: a
dict with ``model`` (or ``module``, the published fine-tuned files) holding the state dict.

- Pretraining (``modeling_pretrain.PretrainVisionTransformer``): the encoder's keys start
  with ``encoder.``; ``decoder.``, ``encoder_to_decoder`` and ``mask_token`` are the pixel
  decoder (ignored: octfw's decoder starts new).
- Fine-tuned (``modeling_finetune.VisionTransformer``): the encoder's keys bare, a class
  ``head`` (ignored), and with mean pooling (its default) no ``norm`` but an ``fc_norm`` of
  the pooled token (ignored; octfw's ``norm`` is then left new).
- Hugging Face (``VideoMAEModel``, ``VideoMAEForPreTraining``, ``...ForVideoClassification``;
  the names of transformers' ``convert_videomae_to_pytorch.py``): ``videomae.`` (optional)
  ``embeddings.patch_embeddings.projection`` -> ``patch_embed.proj``;
  ``encoder.layer.N.attention.attention.{query,key,value}`` + ``q_bias``, ``v_bias`` ->
  ``blocks.N.attn.qkv``; ``attention.output.dense`` -> ``attn.proj``; ``layernorm_before`` /
  ``layernorm_after`` -> ``norm1`` / ``norm2``; ``intermediate.dense`` / ``output.dense`` ->
  ``mlp.fc1`` / ``mlp.fc2``; ``layernorm`` -> ``norm``. Its config states the LayerNorm
  epsilon (transformers' default 1e-12, the original 1e-6): set ``model.norm_eps`` to it.

What is adapted, and why:

- ``attn.qkv``: VideoMAE's qkv projection has no bias; it adds ``q_bias`` and ``v_bias`` with
  a zero key bias (``torch.cat((q_bias, zeros, v_bias))``): octfw's ``qkv.bias`` is exactly
  that concatenation (a checkpoint without them gets a zero bias).
- layer scale (``gamma_1``, ``gamma_2``, fine-tuned with ``init_values``): folded into the
  projection each one scales (``attn.proj``, ``mlp.fc2``): ``gamma * (W x + b)`` is
  ``(gamma W) x + gamma b``, the same output.
- positions: VideoMAE adds a fixed 1D sinusoid table (sin on even channels, cos on odd, over
  the tokens' row-major index) that is not in the checkpoint; octfw computes the table
  VideoMAE builds for the recipe's token count (what VideoMAE itself does at another input
  size) into its ``"learned"`` table, which then trains. A checkpoint with a learned table
  (``use_learnable_pos_emb``) has it resampled to the recipe's grid.
- ``patch_embed.proj.weight``: RGB to one channel and the 2-frame tubelet to the recipe's
  patch (:mod:`octfw.models.published.adapt`).

VideoMAE has no cls token: its tokens are octfw's, one per patch.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from octfw.models.published.mae_common import (fold_layer_scale, load_encoder, merged_qkv, resampled, table_grid,
                                               unwrap)
from octfw.models.published.report import InitReport

__all__ = ["NAME", "detect", "convert", "sinusoid_table", "from_hugging_face"]

NAME = "videomae"
_GROUPS = ("model", "module")
_DECODER = "the pretraining decoder (octfw's pixel decoder starts new)"

#: Hugging Face transformers' VideoMAE names -> the original's, in order.
_HF_NAMES = (
    (r"^videomae\.", ""),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^encoder\.layer\.(\d+)\.", r"blocks.\1."),
    (r"\.attention\.attention\.(q_bias|v_bias)$", r".attn.\1"),
    (r"\.attention\.attention\.(query|key|value)\.weight$", r".attn.\1.weight"),
    (r"\.attention\.output\.dense\.", ".attn.proj."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head."),
    (r"^decoder\.", "decoder."),
)


def _hugging_face(state: Mapping[str, Any]) -> bool:
    return any(re.match(r"^(videomae\.)?embeddings\.patch_embeddings\.projection\.weight$", k) for k in state)


def from_hugging_face(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's VideoMAE state dict under the original's names (query, key and value
    weights merged into ``qkv``)."""
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.startswith(("decoder.", "encoder_to_decoder.", "mask_token")):
            renamed[key] = tensor
            continue
        for pattern, replacement in _HF_NAMES:
            key = re.sub(pattern, replacement, key)
        renamed[key] = tensor
    out: dict[str, torch.Tensor] = {}
    for key, tensor in renamed.items():
        block = re.match(r"^(blocks\.\d+\.attn\.)(query|key|value)\.weight$", key)
        if block is None:
            out[key] = tensor
        elif block.group(2) == "query":
            head = block.group(1)
            out[head + "qkv.weight"] = torch.cat([renamed[f"{head}{p}.weight"] for p in ("query", "key", "value")])
    return out


def _inner(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    inner = unwrap(state, _GROUPS)
    return from_hugging_face(inner) if _hugging_face(inner) else inner


def detect(state: Mapping[str, Any]) -> bool:
    inner = unwrap(state, _GROUPS)
    if _hugging_face(inner):
        return True
    # q_bias / v_bias are VideoMAE's own (every published model has them); encoder_to_decoder its pretraining's.
    return ("encoder_to_decoder.weight" in inner
            or any(re.match(r"^(encoder\.)?blocks\.0\.attn\.q_bias$", k) for k in inner))


def sinusoid_table(tokens: int, width: int) -> torch.Tensor:
    """VideoMAE's fixed position table ``[1, tokens, width]`` (``get_sinusoid_encoding_table``):
    token ``n``, channel ``j``: ``n / 10000 ** (2 (j // 2) / width)``, sine on even channels,
    cosine on odd; computed in float64, returned in float32 as the reference does."""
    position = torch.arange(tokens, dtype=torch.float64)[:, None]
    exponent = 2 * (torch.arange(width) // 2).to(torch.float64) / width
    angles = position / torch.pow(torch.tensor(10000.0, dtype=torch.float64), exponent)[None]
    table = torch.where(torch.arange(width) % 2 == 0, angles.sin(), angles.cos())
    return table.to(torch.float32)[None]


def convert(state: Mapping[str, Any], targets: Any, report: InitReport) -> None:
    """Copy the checkpoint's encoder into ``targets`` (and its EMA encoder), noting each key."""
    inner = _inner(state)
    pretraining = any(k.startswith("encoder.") for k in inner)
    name = "encoder" if pretraining else "network"
    source: dict[str, torch.Tensor] = {}
    for key, tensor in inner.items():
        if pretraining and key.startswith("encoder."):
            key = key[len("encoder."):]
            if key.startswith("head."):
                report.ignored["encoder." + key] = "the encoder's class head"
                continue
            source[key] = tensor
        elif pretraining:
            report.ignored[key] = _DECODER
        elif key.startswith("head."):
            report.ignored[key] = "the fine-tuned class head"
        elif key.startswith("fc_norm."):
            report.ignored[key] = "normalises the mean-pooled token (VideoMAE's fine-tuned networks), not each token"
        elif key.startswith(("decoder.", "encoder_to_decoder.", "mask_token")):
            report.ignored[key] = _DECODER
        else:
            source[key] = tensor
    learned = source.pop("pos_embed", None)
    encoder, adapted = _octfw_names(source)

    def table(network: Any) -> tuple[torch.Tensor, str | None]:
        if learned is None:
            return (sinusoid_table(network.num_patches, network.embed_dim),
                    f"VideoMAE's fixed sinusoid table for {network.num_patches} tokens (not in the checkpoint; "
                    "what VideoMAE builds at this input size), trained here as a learned table")
        grid = table_grid(learned.shape[1], network.grid_size, f"the checkpoint's {name}.pos_embed")
        return resampled(learned, grid, network)

    load_encoder(targets, encoder, table, adapted, report, name, "VideoMAE")


def _octfw_names(source: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The encoder's tensors under octfw's names: qkv biases merged, layer scales folded."""
    out: dict[str, torch.Tensor] = {}
    adapted: dict[str, str] = {}
    blocks = sorted({int(m.group(1)) for k in source if (m := re.match(r"^blocks\.(\d+)\.", k))})
    for key, tensor in source.items():
        if not re.match(r"^blocks\.\d+\.(attn\.(q_bias|v_bias)|gamma_[12])$", key):
            out[key] = tensor
    for index in blocks:
        block = f"blocks.{index}."
        weight = source[block + "attn.qkv.weight"]
        q_bias, v_bias = source.get(block + "attn.q_bias"), source.get(block + "attn.v_bias")
        if q_bias is not None and v_bias is not None:
            out[block + "attn.qkv.bias"] = merged_qkv(q_bias, None, v_bias)
            adapted[block + "attn.qkv.bias"] = "q_bias, a zero key bias and v_bias (VideoMAE has no key bias)"
        else:
            out[block + "attn.qkv.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
            adapted[block + "attn.qkv.bias"] = "zero (the checkpoint's qkv has no bias)"
        for gamma, layer in (("gamma_1", "attn.proj"), ("gamma_2", "mlp.fc2")):
            if block + gamma in source:
                out[block + layer + ".weight"], out[block + layer + ".bias"] = fold_layer_scale(
                    source[block + layer + ".weight"], source[block + layer + ".bias"], source[block + gamma])
                for part in ("weight", "bias"):
                    adapted[f"{block}{layer}.{part}"] = (f"layer scale {gamma} folded in "
                                                         "(gamma * W, gamma * b: the same output)")
    return out, adapted
