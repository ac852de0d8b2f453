"""Record V-JEPA 2.1's predictor and dense loss for the small encoder of
``vjepa2_1_fixtures.py``: the predictor's outputs and the loss, as the reference's train step
computes them, for a fixed clip and two mask configurations.

Runs facebookresearch/vjepa2's ``app/vjepa_2_1`` at the commit of ``vjepa2_1_fixtures.COMMIT``
(read from the public fork n-getty/vjepa2): its ``VisionTransformer`` with the weights of
``tests/fixtures/reference/vjepa2_1/checkpoint.pt`` (run that script first), its
``vit_predictor`` built as ``init_video_model`` builds it for the 2.1 training configs
(``return_all_tokens`` = ``predict_all``, modality embeddings, RoPE with ``interpolate_rope``,
4 levels) at a small size with random weights, both behind the reference's multi-sequence
wrappers. The forward pass and the loss are ``app/vjepa_2_1/train.py``'s ``train_step`` run from
the checkout (:func:`_reference.run_train_step`: its ``forward_target``, ``forward_context``,
``loss_fn`` and forward block) for one clip length and ``levels_predictor = 4``: the target
encoder's 4 levels (each through its ``norms_block``), each layer-normed on its own; the
encoder's levels of each context; the predictor's masked and context predictions; the L1 loss
on the masked tokens plus ``lambda`` times the one on the context tokens, weighted by
``1 / sqrt`` of the distance to the nearest masked patch (``compute_mask_distance``,
``weight_distance_loss`` of the pretraining configs) or not (the cooldown configs), each
averaged over the mask configurations. ``PredictorMultiSeqWrapper`` picks the mask token by
clip length (``mask_index`` 0 here, for both configurations); each configuration's predictions
with ``mask_index = 1`` (the second token) are recorded beside them.

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

from _reference import FIXTURES, REPO, checkout, run_train_step
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

    with torch.no_grad():
        # app/vjepa_2_1/train.py's train step as written there: one clip length of video, the 2.1
        # configs' loss settings (predict_all, loss_exp 1, no cls token, no offset, no predictor
        # normalisation), lambda constant; with and without weight_distance_loss.
        settings = {"torch": torch, "F": F, "apply_masks": apply_masks, "compute_mask_distance": compute_mask_distance,
                    "encoder": encoder, "target_encoder": target_encoder, "predictor": predictor,
                    "clips": [clip], "masks_enc": masks_enc, "masks_pred": masks_pred,
                    "embed_dim_encoder": s["embed_dim"], "levels_predictor": p["levels"], "img_temporal_dim_size": 1,
                    "normalize_predictor": False, "predict_all": True, "loss_exp": 1.0, "has_cls_first": False,
                    "grid_size": grid_size, "offset_context_loss": False, "lambda_progressive": False,
                    "lambda_value": LAMBDA}
        weighted = run_train_step(args.vjepa2, "app/vjepa_2_1/train.py", {**settings, "weight_distance_loss": True})
        unweighted = run_train_step(args.vjepa2, "app/vjepa_2_1/train.py", {**settings, "weight_distance_loss": False})
        h, z_pred, z_context = weighted["h"], weighted["z_pred"], weighted["z_context"]
        distances = weighted["distance_weights"]
        loss_weighted, loss_unweighted = weighted["loss"], unweighted["loss"]
        z = encoder([clip], masks_enc, training_mode=True)  # the context levels the predictor read
        # The predictor itself with its second mask token (the train step never passes 1 for one clip length).
        second_token = [pred(zj, mx, my, mask_index=1, mod="video")
                        for zj, mx, my in zip(z[0], masks_enc[0], masks_pred[0])]

    out = FIXTURES / "vjepa2_1_dense"
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"predictor": {f"module.{k}": v.clone() for k, v in predictor.state_dict().items()}},
               out / "predictor.pt")
    tensors = {"clip": clip, "targets": h[0], "loss_weighted": loss_weighted.reshape(1),
               "loss_unweighted": loss_unweighted.reshape(1)}
    for j in range(len(MASKS)):
        tensors.update({f"context_idx_{j}": masks_enc[0][j], f"target_idx_{j}": masks_pred[0][j],
                        f"context_levels_{j}": z[0][j], f"predicted_{j}": z_pred[0][j],
                        f"predicted_context_{j}": z_context[0][j], f"distance_{j}": distances[0][j],
                        f"predicted_{j}_mask_index_1": second_token[j][0],
                        f"predicted_context_{j}_mask_index_1": second_token[j][1]})
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
                                                 "predictions (mod='video'), as the train step runs it "
                                                 "(PredictorMultiSeqWrapper: mask_index 0, the clip length's, for "
                                                 "every configuration)",
            "predicted_J_mask_index_1 / predicted_context_J_mask_index_1": "the bare predictor on the same inputs "
                                                                           "with mask_index=1 (mask_tokens[1])",
            "distance_J": "compute_mask_distance: sqrt of each context patch's distance to the nearest target patch",
            "loss_weighted": "app/vjepa_2_1/train.py's train step run from the checkout: L1 on the masked tokens + "
                             "lambda * the distance-weighted L1 on the context tokens (weight_distance_loss true: "
                             "the pretraining configs)",
            "loss_unweighted": "the same with an unweighted context loss (weight_distance_loss false: cooldown)",
        },
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for path in sorted(out.iterdir()):
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
