"""Record a small V-JEPA 2 (encoder, EMA target encoder, predictor) in its own checkpoint
format, with fixed inputs and masks and what the reference computes from them.

Runs facebookresearch/vjepa2's own modules at the commit in ``_reference.REFERENCES``
(``src/models/vision_transformer.py``, ``src/models/predictor.py``, the wrappers of
``src/utils/wrappers.py``) at a small size with random weights: every parameter drawn
at random (biases, LayerNorms and mask tokens included, so that each one matters), RoPE
as V-JEPA 2 trains (``use_rope``, LayerNorm eps 1e-6, ``vit_predictor`` with mask tokens).
The forward pass and the loss are ``app/vjepa/train.py``'s own, run from the checkout
(:func:`_reference.run_train_step`: its ``forward_target``, ``forward_context``, ``loss_fn``
and forward block, one clip length, ``loss_exp`` 1): the target encoder on the full clip,
layer-normed; the encoder on each mask configuration's context; the predictor on each; the
L1 loss averaged over the configurations. The predictor runs behind the reference's
``PredictorMultiSeqWrapper``, which picks the mask token by clip length (``mask_index`` is
the clip length's place, 0 here), so both configurations use ``mask_tokens[0]``; each
configuration's predictor is also recorded with ``mask_index = 1`` (the second token), what a
token per mask configuration would compute.

It writes to ``tests/fixtures/reference/vjepa2/``:

- ``checkpoint.pt``: ``{"encoder", "predictor", "target_encoder", "epoch"}`` with the
  reference's ``module.backbone.`` keys (DDP around the multi-sequence wrapper), loadable
  with ``torch.load(weights_only=True)``;
- ``tensors.safetensors``: the clip, the masks, the tokens of both encoders on the full
  clip, each configuration's context tokens and predictions (with either token), the loss;
- ``meta.json``: the reference (repo, commit), the sizes and how each tensor was made;
- ``published_shapes.json``: the state-dict shapes of the published ViT-L and ViT-g
  networks (encoder and predictor), so that a test holds the ``large`` and ``giant``
  presets to them without a download.

tests/test_published_weights.py loads the checkpoint through ``[model] init`` and compares
octfw's networks with these tensors, without the reference code.

Usage (the reference's imports beyond octfw's venv, timm and einops, in a folder of their own)::

    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/vjepa2_fixtures.py --vjepa2 /tmp/ref/vjepa2
"""

from __future__ import annotations

import argparse
import copy
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from _reference import FIXTURES, REPO, checkout, run_train_step

#: The small V-JEPA 2: clip, patch, encoder and predictor sizes (heads of 16 channels: RoPE turns
#: 12 of them, 4 per axis, and leaves 4, as V-JEPA 2 leaves 4 of its 64).
SIZES = {
    "batch": 2, "in_chans": 3, "num_frames": 8, "crop_size": 32, "patch_size": 16, "tubelet_size": 2,
    "embed_dim": 48, "depth": 2, "num_heads": 3, "mlp_ratio": 4.0,
    "pred_embed_dim": 32, "pred_depth": 2, "pred_num_heads": 2, "num_mask_tokens": 2,
}
#: Two mask configurations, each its own (context, target) pair over the 16 patches of the
#: 4 x 2 x 2 grid: (context count, target count) per sample.
MASKS = ((10, 6), (12, 4))
SEED = 20261127


def randomise(module: nn.Module, generator: torch.Generator) -> None:
    """Every parameter drawn anew: weights ~ N(0, 0.05), biases ~ N(0, 0.02), LayerNorm
    weights ~ 1 + N(0, 0.1), mask tokens ~ N(0, 0.5)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "mask_tokens" in name:
                param.copy_(0.5 * noise)
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.02 * noise)
            else:
                param.copy_(0.05 * noise)


def masks(generator: torch.Generator, batch: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per configuration, ``(context [B, Nc], target [B, Nt])``: each sample's own random
    split of the patches, in random order (the reference sorts them in its predictor)."""
    pairs = []
    for context, target in MASKS:
        order = torch.stack([torch.randperm(tokens, generator=generator) for _ in range(batch)])
        pairs.append((order[:, :context].clone(), order[:, context:context + target].clone()))
    return pairs


def published_shapes() -> dict:
    """The state-dict shapes of the published V-JEPA 2 networks, as ``src/hub/backbones.py``
    builds them (ViT-L ``vit_large`` and ViT-g ``vit_giant_xformers`` encoders with RoPE,
    256 px, 64 frames; the predictor 384 wide, 12 deep, 12 heads, 10 mask tokens), with the
    training checkpoint's key prefixes. Built on the meta device: shapes only, no weights."""
    from src.models import predictor as reference_predictor
    from src.models import vision_transformer as reference_vit

    linspace = torch.linspace  # the reference reads its drop-path rates with .item(), not on meta
    torch.linspace = lambda *args, **kwargs: linspace(*args, **{**kwargs, "device": "cpu"})
    shapes = {"source": "src/hub/backbones.py _make_vjepa2_model: vjepa2_vit_large, vjepa2_vit_giant"}
    try:
        with torch.device("meta"):
            for name in ("vit_large", "vit_giant_xformers"):
                encoder = reference_vit.__dict__[name](img_size=(256, 256), patch_size=16, num_frames=64,
                                                       tubelet_size=2, use_rope=True, use_sdpa=True)
                predictor = reference_predictor.vit_predictor(
                    img_size=(256, 256), patch_size=16, use_mask_tokens=True, embed_dim=encoder.embed_dim,
                    predictor_embed_dim=384, num_frames=64, tubelet_size=2, depth=12, num_heads=12,
                    num_mask_tokens=10, use_rope=True)
                shapes[name] = {
                    "num_heads": encoder.num_heads,
                    **{group: {f"module.backbone.{k}": list(v.shape) for k, v in net.state_dict().items()}
                       for group, net in (("encoder", encoder), ("predictor", predictor))},
                }
    finally:
        torch.linspace = linspace
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vjepa2", required=True, help="a checkout of facebookresearch/vjepa2")
    args = parser.parse_args()
    reference = checkout("vjepa2", args.vjepa2)

    from safetensors.torch import save_file
    from src.masks.utils import apply_masks
    from src.models.predictor import vit_predictor
    from src.models.vision_transformer import VisionTransformer
    from src.utils.wrappers import MultiSeqWrapper, PredictorMultiSeqWrapper

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    s = SIZES
    common = dict(img_size=(s["crop_size"], s["crop_size"]), patch_size=s["patch_size"],
                  num_frames=s["num_frames"], tubelet_size=s["tubelet_size"], use_rope=True, use_sdpa=True,
                  uniform_power=False)
    # vit_large & co. are VisionTransformer(..., qkv_bias=True, norm_layer=LayerNorm(eps=1e-6)) at their sizes.
    vit = VisionTransformer(in_chans=s["in_chans"], embed_dim=s["embed_dim"], depth=s["depth"],
                            num_heads=s["num_heads"], mlp_ratio=s["mlp_ratio"], qkv_bias=True,
                            norm_layer=partial(nn.LayerNorm, eps=1e-6), **common)
    pred = vit_predictor(embed_dim=s["embed_dim"], predictor_embed_dim=s["pred_embed_dim"], depth=s["pred_depth"],
                         num_heads=s["pred_num_heads"], use_mask_tokens=True, num_mask_tokens=s["num_mask_tokens"],
                         zero_init_mask_tokens=True, **common)
    randomise(vit, generator)
    randomise(pred, generator)
    target_vit = copy.deepcopy(vit)
    randomise(target_vit, generator)  # an EMA encoder that has drifted from the online one
    encoder, target_encoder = MultiSeqWrapper(vit).eval(), MultiSeqWrapper(target_vit).eval()
    predictor = PredictorMultiSeqWrapper(pred).eval()

    clip = torch.randn(s["batch"], s["in_chans"], s["num_frames"], s["crop_size"], s["crop_size"], generator=generator)
    tokens = vit.num_patches
    pairs = masks(generator, s["batch"], tokens)
    masks_enc, masks_pred = [c for c, _ in pairs], [t for _, t in pairs]

    with torch.no_grad():
        target_tokens = target_encoder([clip])[0]  # [B, N, E], the target encoder's features
        # app/vjepa/train.py's train step as written there, for one clip length and loss_exp 1.
        step = run_train_step(args.vjepa2, "app/vjepa/train.py", {
            "torch": torch, "F": F, "apply_masks": apply_masks, "loss_exp": 1.0,
            "encoder": encoder, "target_encoder": target_encoder, "predictor": predictor,
            "clips": [clip], "masks_enc": [masks_enc], "masks_pred": [masks_pred]})
        z, loss = step["z"], step["loss"]
        context_tokens = encoder([clip], [masks_enc])[0]
        online_tokens = vit(clip)
        # The predictor itself with its second mask token (the train step never passes 1 for one clip length).
        second_token = [pred(ctx, c, t, mask_index=1) for ctx, (c, t) in zip(context_tokens, pairs)]

    out = FIXTURES / "vjepa2"
    out.mkdir(parents=True, exist_ok=True)

    def ddp(state: dict) -> dict:  # the training checkpoint's keys: DDP's "module." before the wrapper's
        return {f"module.{k}": v.clone() for k, v in state.items()}

    torch.save({"encoder": ddp(encoder.state_dict()), "predictor": ddp(predictor.state_dict()),
                "target_encoder": ddp(target_encoder.state_dict()), "epoch": 1}, out / "checkpoint.pt")
    tensors = {"clip": clip, "target_tokens": target_tokens, "online_tokens": online_tokens,
               "loss": loss.reshape(1)}
    for j, ((context, target), ctx, pred_j, second_j) in enumerate(zip(pairs, context_tokens, z[0], second_token)):
        tensors.update({f"context_idx_{j}": context, f"target_idx_{j}": target,
                        f"context_tokens_{j}": ctx, f"predicted_{j}": pred_j,
                        f"predicted_{j}_mask_index_1": second_j})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "tensors.safetensors"))
    meta = {
        "what": "a small V-JEPA 2 built from the reference's modules with random weights, its checkpoint in the "
                "reference's format, and the reference's outputs; regenerate with tools/parity/vjepa2_fixtures.py",
        "reference": reference, "seed": SEED, "sizes": SIZES,
        "masks": [{"context": c, "target": t} for c, t in MASKS],
        "tensors": {
            "clip": "[B, 3, T, H, W] input clip (standard normal)",
            "target_tokens": "target_encoder(clip): [B, N, E], no mask",
            "online_tokens": "encoder(clip): [B, N, E], no mask",
            "context_idx_J / target_idx_J": "mask configuration J's kept and predicted patch indices [B, K]",
            "context_tokens_J": "encoder(clip, masks=context_idx_J): [B, Nc, E]",
            "predicted_J": "predictor(context_tokens_J, context_idx_J, target_idx_J): [B, Nt, E], as the train "
                           "step runs it (PredictorMultiSeqWrapper: mask_index 0, the clip length's, for every "
                           "configuration)",
            "predicted_J_mask_index_1": "the bare predictor on the same inputs with mask_index=1 (mask_tokens[1])",
            "loss": "app/vjepa/train.py's train step run from the checkout (forward_target, forward_context, "
                    "loss_fn): mean over configurations of mean |predicted - layer_norm(target)|",
        },
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "published_shapes.json").write_text(json.dumps(published_shapes()) + "\n")
    for path in sorted(out.iterdir()):
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
