"""Record small MAE-family encoders (VideoMAE, MAE-ST, RETFound) in their own checkpoint
formats, with fixed inputs and the tokens the reference computes from them.

One source per run, each from a checkout at the commit ``_reference.REFERENCES`` names
(a git checkout at another commit is refused):

- ``videomae`` (MCG-NJU/VideoMAE): ``modeling_pretrain.PretrainVisionTransformer`` (its
  ``encoder.`` keys, the decoder beside it, saved as ``{"model": ...}`` as
  ``utils.save_model`` does) and ``modeling_finetune.VisionTransformer`` with layer scale
  (``gamma_1``, ``gamma_2``) and a class head, saved as ``{"module": ...}``. q_bias / v_bias,
  the fixed 1D sinusoid position table, tubelet 2, LayerNorm eps 1e-6, no cls token. The
  pretraining encoder is built for its default 16 frames; tokens are its output on every
  patch (an all-visible mask), the fine-tuned network's are its ``norm``'s output.
- ``mae_st`` (facebookresearch/mae_st): ``models_mae.MaskedAutoencoderViT`` as its
  pretraining runs it (``sep_pos_embed``, ``cls_embed``), saved as ``{"model_state": ...}``
  as its fine-tuning reads published weights. Tokens: ``forward_encoder`` at mask ratio 0
  (the cls token removed after the norm, as the reference does), put back in patch order
  with its ``ids_restore``; and the same weights in the reference built with
  ``cls_embed=False``: the patch tokens alone, as octfw computes them.
- ``retfound`` (rmaphoh/RETFound_MAE): ``models_vit.VisionTransformer`` (timm's ViT with its
  cls token) at a small size, saved as ``{"model": ...}``. Tokens: its ``norm``'s output in
  ``forward_features`` (cls first); and timm's ``VisionTransformer`` (RETFound's base class)
  built without a class token, same weights (the table's cls row dropped): the patch tokens
  alone, on the RGB image and on a grey one (one channel repeated three times).

Every parameter is drawn at random (weights ~ N(0, 0.05), biases ~ N(0, 0.02), LayerNorm
weights ~ 1 + N(0, 0.1), tables and tokens ~ N(0, 0.5), layer scales ~ 0.5 + N(0, 0.1)).

Writes ``tests/fixtures/reference/<source>/``: ``checkpoint.pt`` (and ``finetuned.pt`` for
VideoMAE; ``torch.load(weights_only=True)`` reads them), ``tensors.safetensors`` and
``meta.json`` (the reference's repo and commit, the sizes) and ``published_shapes.json``
(the state-dict shapes of the published ViT-B / ViT-L networks, built on the meta device by
the reference's own model functions). tests/test_published_mae_family.py
reads them without the reference code.

Usage (timm and the reference's other imports in a folder of their own)::

    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/mae_family_fixtures.py videomae /tmp/ref/videomae
    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/mae_family_fixtures.py mae_st /tmp/ref/mae_st
    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/mae_family_fixtures.py retfound /tmp/ref/retfound

(mae_st imports itself as the package ``mae_st``: its checkout's folder must be named so.)
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

from _reference import FIXTURES, REPO, checkout

SEED = 20261128
#: Small sizes for all three (the fixtures stay tens of KB): heads of 8 channels, 2 blocks,
#: 4-pixel patches.
SIZES = {"batch": 2, "in_chans": 3, "embed_dim": 16, "depth": 2, "num_heads": 2, "mlp_ratio": 4.0,
         "patch_size": 4, "decoder_embed_dim": 8, "decoder_depth": 1, "decoder_num_heads": 2}


def randomise(module: nn.Module, generator: torch.Generator) -> None:
    """Every parameter drawn anew, so that each one matters."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            leaf = name.rsplit(".", 1)[-1]
            if leaf.startswith("gamma_"):
                param.copy_(0.5 + 0.1 * noise)
            elif "norm" in name and leaf == "weight":
                param.copy_(1.0 + 0.1 * noise)
            elif "pos_embed" in name or "token" in name:
                param.copy_(0.5 * noise)
            elif leaf.endswith("bias"):
                param.copy_(0.02 * noise)
            else:
                param.copy_(0.05 * noise)


def norm_output(model: nn.Module, norm: nn.Module, call) -> torch.Tensor:
    """What ``norm`` returns while ``call()`` runs the reference's own forward."""
    seen = []
    handle = norm.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            call()
    finally:
        handle.remove()
    return seen[-1]


def videomae(generator: torch.Generator) -> tuple[dict, dict, dict]:
    from modeling_finetune import VisionTransformer
    from modeling_pretrain import PretrainVisionTransformer

    s = SIZES
    norm = partial(nn.LayerNorm, eps=1e-6)
    sizes = {**s, "img_size": 8, "tubelet_size": 2, "pretrain_frames": 16, "finetune_frames": 4,
             "init_values": 0.1, "num_classes": 5}
    pretrain = PretrainVisionTransformer(
        img_size=8, patch_size=4, encoder_embed_dim=16, encoder_depth=2, encoder_num_heads=2,
        decoder_num_classes=3 * 2 * 4 * 4, decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2,
        mlp_ratio=4, qkv_bias=True, norm_layer=norm, tubelet_size=2).eval()
    finetune = VisionTransformer(
        img_size=8, patch_size=4, num_classes=5, embed_dim=16, depth=2, num_heads=2, mlp_ratio=4,
        qkv_bias=True, norm_layer=norm, init_values=0.1, all_frames=4, tubelet_size=2,
        use_mean_pooling=False).eval()
    randomise(pretrain, generator)
    randomise(finetune, generator)
    clip = torch.randn(2, 3, 16, 8, 8, generator=generator)
    short = torch.randn(2, 3, 4, 8, 8, generator=generator)
    visible = torch.zeros(2, pretrain.encoder.patch_embed.num_patches, dtype=torch.bool)
    with torch.no_grad():
        tokens = pretrain.encoder(clip, visible)
    finetuned = norm_output(finetune, finetune.norm, lambda: finetune.forward_features(short))
    checkpoints = {"checkpoint.pt": {"model": pretrain.state_dict(), "epoch": 0},
                   "finetuned.pt": {"module": finetune.state_dict(), "epoch": 0}}
    tensors = {"clip": clip, "tokens": tokens, "short_clip": short, "finetuned_tokens": finetuned}
    return checkpoints, tensors, sizes


def mae_st(generator: torch.Generator) -> tuple[dict, dict, dict]:
    from mae_st.models_mae import MaskedAutoencoderViT

    norm = partial(nn.LayerNorm, eps=1e-6)
    sizes = {**SIZES, "img_size": 8, "num_frames": 4, "t_patch_size": 2, "sep_pos_embed": True,
             "cls_embed": True}

    def build(cls_embed: bool) -> nn.Module:
        return MaskedAutoencoderViT(
            img_size=8, patch_size=4, in_chans=3, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8,
            decoder_depth=1, decoder_num_heads=2, mlp_ratio=4.0, norm_layer=norm, num_frames=4,
            t_patch_size=2, sep_pos_embed=True, cls_embed=cls_embed, pred_t_dim=4).eval()

    model, without_cls = build(True), build(False)
    randomise(model, generator)
    state = model.state_dict()
    cls_only = ("cls_token", "decoder_cls_token", "pos_embed_class", "decoder_pos_embed_class")
    without_cls.load_state_dict({k: v for k, v in state.items() if k not in cls_only}, strict=True)
    clip = torch.randn(2, 3, 4, 8, 8, generator=generator)

    def patch_order(network: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            tokens, _, ids_restore = network.forward_encoder(clip, 0.0)
        return torch.gather(tokens, 1, ids_restore[..., None].expand(-1, -1, tokens.shape[-1]))

    torch.manual_seed(SEED)
    tensors = {"clip": clip, "tokens_with_cls": patch_order(model), "tokens": patch_order(without_cls)}
    return {"checkpoint.pt": {"model_state": state, "epoch": 0}}, tensors, sizes


def retfound(generator: torch.Generator) -> tuple[dict, dict, dict]:
    import timm.models.vision_transformer as timm_vit
    from models_vit import VisionTransformer

    norm = partial(nn.LayerNorm, eps=1e-6)
    sizes = {**SIZES, "img_size": 16}
    common = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, mlp_ratio=4, qkv_bias=True,
                  norm_layer=norm, num_classes=0)
    model = VisionTransformer(global_pool=False, **common).eval()
    without_cls = timm_vit.VisionTransformer(class_token=False, global_pool="avg", fc_norm=False, **common).eval()
    randomise(model, generator)
    state = model.state_dict()
    without_cls.load_state_dict({**{k: v for k, v in state.items() if k != "cls_token"},
                                 "pos_embed": state["pos_embed"][:, 1:]}, strict=True)
    image = torch.randn(2, 3, 16, 16, generator=generator)
    grey = torch.randn(2, 1, 16, 16, generator=generator).expand(-1, 3, -1, -1).contiguous()
    with_cls = norm_output(model, model.norm, lambda: model.forward_features(image))
    with torch.no_grad():
        tokens, grey_tokens = without_cls.forward_features(image), without_cls.forward_features(grey)
    tensors = {"image": image, "tokens_with_cls": with_cls, "tokens": tokens, "grey_image": grey[:, :1],
               "grey_tokens": grey_tokens}
    return {"checkpoint.pt": {"model": state, "epoch": 0}}, tensors, sizes


SOURCES = {"videomae": videomae, "mae_st": mae_st, "retfound": retfound}


def published_networks(source: str) -> dict[str, nn.Module]:
    """The published networks of ``source`` as the reference builds them (its own model
    functions and its pretraining defaults), by octfw preset name."""
    if source == "videomae":
        from modeling_pretrain import pretrain_videomae_base_patch16_224, pretrain_videomae_large_patch16_224

        return {"base": pretrain_videomae_base_patch16_224(), "large": pretrain_videomae_large_patch16_224()}
    if source == "mae_st":
        from mae_st.models_mae import mae_vit_base_patch16, mae_vit_large_patch16

        defaults = dict(num_frames=16, t_patch_size=2, sep_pos_embed=True, cls_embed=True, pred_t_dim=8)
        return {"base": mae_vit_base_patch16(**defaults), "large": mae_vit_large_patch16(**defaults)}
    from models_vit import RETFound_mae

    return {"large": RETFound_mae(img_size=224, num_classes=0, global_pool=False)}


def published_shapes(source: str) -> dict:
    """The state-dict shapes of ``source``'s published networks, built on the meta device
    (shapes only, no weights), so that a test holds octfw's presets to them."""
    linspace = torch.linspace  # the references read their drop-path rates with .item(), not on meta
    torch.linspace = lambda *args, **kwargs: linspace(*args, **{**kwargs, "device": "cpu"})
    try:
        with torch.device("meta"):
            networks = published_networks(source)
    finally:
        torch.linspace = linspace
    return {preset: {key: list(value.shape) for key, value in network.state_dict().items()}
            for preset, network in networks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", choices=sorted(SOURCES))
    parser.add_argument("checkout", help="a checkout of the source's repository at the named commit")
    args = parser.parse_args()
    reference = checkout(args.source, args.checkout)
    if args.source == "mae_st":  # it imports itself as the package mae_st
        root = Path(args.checkout).resolve()
        if root.name != "mae_st":
            raise SystemExit(f"mae_st: the checkout's folder must be named mae_st, not {root.name}")
        sys.path.insert(0, str(root.parent))

    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    checkpoints, tensors, sizes = SOURCES[args.source](generator)
    out = FIXTURES / args.source
    out.mkdir(parents=True, exist_ok=True)
    for name, payload in checkpoints.items():
        torch.save(payload, out / name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "tensors.safetensors"))
    meta = {"reference": reference, "seed": SEED, "sizes": sizes,
            "tool": "tools/parity/mae_family_fixtures.py", "tensors": {k: list(v.shape) for k, v in tensors.items()}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "published_shapes.json").write_text(json.dumps(published_shapes(args.source)) + "\n")
    for path in sorted(out.iterdir()):
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
