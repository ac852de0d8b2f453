"""Record V-JEPA 2.1's predictor and dense loss for the small encoder of
``vjepa2_1_fixtures.py``: the predictor's outputs and the loss, as the reference's train step
computes them, for a fixed clip and two mask configurations.

Runs facebookresearch/vjepa2's ``app/vjepa_2_1`` at the commit of ``vjepa2_1_fixtures.COMMIT``
(read from the public fork n-getty/vjepa2): its ``VisionTransformer`` with the weights of
``tests/fixtures/reference/vjepa2_1/checkpoint.pt`` (run that script first), its
``vit_predictor`` built as ``init_video_model`` builds it for the 2.1 training configs
(``return_all_tokens`` = ``predict_all``, modality embeddings, RoPE with ``interpolate_rope``,
4 levels) at a small size with random weights, both behind the reference's multi-sequence
wrappers. The forward pass is ``app/vjepa_2_1/train.py``'s ``train_step`` for one clip length
and ``levels_predictor = 4``: the target encoder's 4 levels (each through its ``norms_block``),
each layer-normed on its own; the encoder's levels of each context; the predictor's masked
and context predictions; the L1 loss on the masked tokens plus ``lambda`` times the one on the
context tokens, weighted by ``1 / sqrt`` of the distance to the nearest masked patch
(``compute_mask_distance``, ``weight_distance_loss`` of the pretraining configs) or not (the
cooldown configs), each averaged over the mask configurations.

It writes ``tests/fixtures/reference/vjepa2_1_dense/``: ``predictor.pt`` (``predictor``, with
the training checkpoint's ``module.backbone.`` keys: add it to the encoder checkpoint to get
the reference's training checkpoint), ``tensors.safetensors`` and ``meta.json``.

Usage (timm, einops and torchvision in a folder of their own)::

    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/vjepa2_1_dense_fixtures.py --vjepa2 /tmp/ref21
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from _reference import FIXTURES, REPO, checkout
from vjepa2_1_fixtures import COMMIT, SIZES
from vjepa2_fixtures import randomise

#: The predictor: 4 blocks (the reference knows its levels for predictor depths 4, 8, 12, 20,
#: 24 and 40 only), as wide as the encoder, 2 heads of 12 channels (all turned by RoPE).
PREDICTOR = {"pred_embed_dim": 24, "pred_depth": 4, "pred_num_heads": 2, "num_mask_tokens": 2, "levels": 4}
#: Two mask configurations over the 18 patches of the 2 x 3 x 3 grid: (context, target) per sample.
MASKS = ((11, 7), (13, 5))
#: The context loss's weight (lambda_value_vid of every 2.1 config; constant: lambda_progressive off).
LAMBDA = 0.5
SEED = 20261129


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vjepa2", required=True, help=f"a checkout of facebookresearch/vjepa2 at {COMMIT}")
    args = parser.parse_args()
    reference = checkout("vjepa2", args.vjepa2, commit=COMMIT)
    reference["read_from"] = "https://github.com/n-getty/vjepa2 (a fork carrying the upstream commit)"

    from safetensors.torch import save_file
    from app.vjepa_2_1.models.predictor import vit_predictor
    from app.vjepa_2_1.models.utils.masks_dist import compute_mask_distance
    from app.vjepa_2_1.models.vision_transformer import VisionTransformer
    from app.vjepa_2_1.wrappers import MultiSeqWrapper, PredictorMultiSeqWrapper
    from src.masks.utils import apply_masks

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    s, p = SIZES, PREDICTOR
    grid_size = s["crop_size"] // s["patch_size"]
    common = dict(img_size=(s["crop_size"], s["crop_size"]), patch_size=s["patch_size"], num_frames=s["num_frames"],
                  tubelet_size=s["tubelet_size"], use_rope=True, interpolate_rope=True, img_temporal_dim_size=1,
                  uniform_power=False, modality_embedding=True)
    encoders = torch.load(FIXTURES / "vjepa2_1" / "checkpoint.pt", weights_only=True)
    networks = {}
    for group in ("encoder", "ema_encoder"):
        vit = VisionTransformer(in_chans=s["in_chans"], embed_dim=s["embed_dim"], depth=s["depth"],
                                num_heads=s["num_heads"], mlp_ratio=s["mlp_ratio"], qkv_bias=True,
                                norm_layer=partial(nn.LayerNorm, eps=1e-6), use_sdpa=True, **common)
        vit.load_state_dict({k.removeprefix("module.backbone."): v for k, v in encoders[group].items()})
        networks[group] = MultiSeqWrapper(vit).eval()
    pred = vit_predictor(embed_dim=s["embed_dim"], predictor_embed_dim=p["pred_embed_dim"], depth=p["pred_depth"],
                         num_heads=p["pred_num_heads"], use_mask_tokens=True, num_mask_tokens=p["num_mask_tokens"],
                         zero_init_mask_tokens=True, return_all_tokens=True, use_sdpa=True, **common)
    randomise(pred, generator)
    with torch.no_grad():  # modality embeddings as large as the tokens, so that they matter
        pred.video_mod_embed.copy_(0.5 * torch.randn(pred.video_mod_embed.shape, generator=generator))
    predictor = PredictorMultiSeqWrapper(pred).eval()
    encoder, target_encoder = networks["encoder"], networks["ema_encoder"]

    clip = torch.randn(s["batch"], s["in_chans"], s["num_frames"], s["crop_size"], s["crop_size"], generator=generator)
    tokens = pred.num_patches
    masks_enc, masks_pred = [], []
    for context, target in MASKS:
        order = torch.stack([torch.randperm(tokens, generator=generator) for _ in range(s["batch"])])
        masks_enc.append(order[:, :context].clone())
        masks_pred.append(order[:, context:context + target].clone())
    masks_enc, masks_pred = [masks_enc], [masks_pred]  # [clip length][mask configuration]
    embed_dim = s["embed_dim"]

    with torch.no_grad():
        # train.py forward_target, levels_predictor = 4: each level layer-normed on its own.
        h = []
        for hi in target_encoder([clip], training_mode=True):
            h.append(torch.cat([F.layer_norm(hi[:, :, k * embed_dim:(k + 1) * embed_dim], (embed_dim,))
                                for k in range(p["levels"])], dim=2))
        # forward_context (normalize_predictor false in every 2.1 config).
        z = encoder([clip], masks_enc, training_mode=True)
        z_pred, z_context = predictor(z, masks_enc, masks_pred, mod="video")

        def loss_fn(z, h, masks_to_apply, d_weights):  # train.py's loss_fn, cls_loss false, loss_exp 1
            h = [apply_masks(hi, mi, concat=False) for hi, mi in zip(h, masks_to_apply)]
            loss, n = 0, 0
            for i, (zi, hi) in enumerate(zip(z, h)):
                for j, (zij, hij) in enumerate(zip(zi, hi)):
                    loss_n = torch.abs(zij - hij) ** 1.0
                    if d_weights is not None:
                        loss_n = loss_n * (1 / d_weights[i][j].unsqueeze(2))
                    loss += torch.mean(loss_n) / 1.0
                    n += 1
            return loss / n

        loss_pred = loss_fn(z_pred, h, masks_pred, None)
        distances = compute_mask_distance(masks_pred, masks_enc, grid_size, False)
        loss_weighted = loss_pred + LAMBDA * loss_fn(z_context, h, masks_enc, distances)
        loss_unweighted = loss_pred + LAMBDA * loss_fn(z_context, h, masks_enc, None)

    out = FIXTURES / "vjepa2_1_dense"
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"predictor": {f"module.{k}": v.clone() for k, v in predictor.state_dict().items()}},
               out / "predictor.pt")
    tensors = {"clip": clip, "targets": h[0], "loss_weighted": loss_weighted.reshape(1),
               "loss_unweighted": loss_unweighted.reshape(1)}
    for j in range(len(MASKS)):
        tensors.update({f"context_idx_{j}": masks_enc[0][j], f"target_idx_{j}": masks_pred[0][j],
                        f"context_levels_{j}": z[0][j], f"predicted_{j}": z_pred[0][j],
                        f"predicted_context_{j}": z_context[0][j], f"distance_{j}": distances[0][j]})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "tensors.safetensors"))
    meta = {
        "what": "V-JEPA 2.1's predictor (random weights) over the small encoder of tests/fixtures/reference/vjepa2_1, "
                "its outputs and app/vjepa_2_1/train.py's loss; regenerate with "
                "tools/parity/vjepa2_1_dense_fixtures.py",
        "reference": reference, "seed": SEED, "sizes": SIZES, "predictor": PREDICTOR,
        "masks": [{"context": c, "target": t} for c, t in MASKS], "lambda": LAMBDA,
        "tensors": {
            "clip": "[B, 3, T, H, W] input clip (standard normal)",
            "targets": "ema_encoder(clip, training_mode=True), each of the 4 levels layer-normed: [B, N, 4E]",
            "context_idx_J / target_idx_J": "mask configuration J's kept and predicted patch indices [B, K]",
            "context_levels_J": "encoder(clip, masks=context_idx_J, training_mode=True): [B, Nc, 4E]",
            "predicted_J / predicted_context_J": "predictor(...): its masked [B, Nt, 4E] and context [B, Nc, 4E] "
                                                 "predictions (mod='video', mask_index 0)",
            "distance_J": "compute_mask_distance: sqrt of each context patch's distance to the nearest target patch",
            "loss_weighted": "L1 on the masked tokens + lambda * the distance-weighted L1 on the context tokens "
                             "(weight_distance_loss true: the pretraining configs)",
            "loss_unweighted": "the same with an unweighted context loss (weight_distance_loss false: cooldown)",
        },
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for path in sorted(out.iterdir()):
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
