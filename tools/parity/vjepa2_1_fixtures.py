"""Record a small V-JEPA 2.1 encoder (online and EMA) in its own checkpoint format, with a
fixed clip and mask and the tokens the reference computes from them.

Runs facebookresearch/vjepa2's ``app/vjepa_2_1/models/vision_transformer.py`` at the commit
named below (V-JEPA 2.1 arrived in March 2026, after the snapshot of
``_reference.REFERENCES``; this commit of the upstream history was read from the public fork
n-getty/vjepa2, which carries it unchanged) at a small size with random weights: every
parameter drawn at random, modality embeddings and hierarchical norms included; RoPE with
``interpolate_rope`` as its training configs set it, LayerNorm eps 1e-6, the image patch
projection (``img_temporal_dim_size=1``) as the hub builds it. Depth 12: the reference
knows its hierarchical levels for 12, 24, 40 and 48 blocks only.

It writes ``tests/fixtures/reference/vjepa2_1/``: ``checkpoint.pt`` (``encoder`` and
``ema_encoder``, ``module.backbone.`` keys, as the hub's distilled models name them),
``tensors.safetensors`` (the clip, a mask, each encoder's tokens of the full clip, the
online encoder's of the masked one), ``meta.json``, and ``published_shapes.json`` (the
state-dict shapes of the published ViT-L and ViT-g encoders, for the presets' test).

Usage (timm and einops in a folder of their own)::

    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/vjepa2_1_fixtures.py --vjepa2 /tmp/ref21
"""

from __future__ import annotations

import argparse
import copy
import json
from functools import partial

import torch
from torch import nn

from _reference import FIXTURES, REPO, checkout
from vjepa2_fixtures import randomise

#: The upstream commit with app/vjepa_2_1 ("Fix figure (#143)", after "V-JEPA 2.1 (#130)").
COMMIT = "204698b45b3712590f06245fbfba32d3be539812"
SIZES = {"batch": 2, "in_chans": 3, "num_frames": 4, "crop_size": 48, "patch_size": 16, "tubelet_size": 2,
         "embed_dim": 24, "depth": 12, "num_heads": 2, "mlp_ratio": 4.0}
#: Patches the masked forward keeps, per sample (of the 2 x 3 x 3 grid).
KEEP = 11
SEED = 20261128


def published_shapes() -> dict:
    """The state-dict shapes of the published V-JEPA 2.1 ViT-L and ViT-g encoders, as
    ``src/hub/backbones.py`` ``_make_vjepa2_1_model`` builds them (384 px, 64 frames, RoPE with
    ``interpolate_rope``, the image patch projection), with the checkpoint's key prefixes.
    Built on the meta device: shapes only."""
    from app.vjepa_2_1.models import vision_transformer as reference_vit

    linspace = torch.linspace  # the reference reads its drop-path rates with .item(), not on meta
    torch.linspace = lambda *args, **kwargs: linspace(*args, **{**kwargs, "device": "cpu"})
    shapes = {"source": "src/hub/backbones.py _make_vjepa2_1_model: vjepa2_1_vit_large_384, vjepa2_1_vit_giant_384"}
    try:
        with torch.device("meta"):
            for name in ("vit_large", "vit_giant_xformers"):
                encoder = reference_vit.__dict__[name](
                    img_size=(384, 384), patch_size=16, num_frames=64, tubelet_size=2, use_sdpa=True,
                    uniform_power=False, use_rope=True, img_temporal_dim_size=1, interpolate_rope=True)
                shapes[name] = {"num_heads": encoder.num_heads,
                                "encoder": {f"module.backbone.{k}": list(v.shape)
                                            for k, v in encoder.state_dict().items()}}
    finally:
        torch.linspace = linspace
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vjepa2", required=True, help=f"a checkout of facebookresearch/vjepa2 at {COMMIT}")
    args = parser.parse_args()
    reference = checkout("vjepa2", args.vjepa2, commit=COMMIT)
    reference["read_from"] = "https://github.com/n-getty/vjepa2 (a fork carrying the upstream commit)"

    from safetensors.torch import save_file
    from app.vjepa_2_1.models.vision_transformer import VisionTransformer

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    s = SIZES
    vit = VisionTransformer(
        img_size=(s["crop_size"], s["crop_size"]), patch_size=s["patch_size"], num_frames=s["num_frames"],
        tubelet_size=s["tubelet_size"], in_chans=s["in_chans"], embed_dim=s["embed_dim"], depth=s["depth"],
        num_heads=s["num_heads"], mlp_ratio=s["mlp_ratio"], qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6),
        use_rope=True, interpolate_rope=True, img_temporal_dim_size=1, use_sdpa=True, uniform_power=False)
    randomise(vit, generator)
    with torch.no_grad():  # modality embeddings as large as the tokens, so that they matter
        vit.video_mod_embed.copy_(0.5 * torch.randn(vit.video_mod_embed.shape, generator=generator))
    ema = copy.deepcopy(vit)
    randomise(ema, generator)
    vit.eval(), ema.eval()

    clip = torch.randn(s["batch"], s["in_chans"], s["num_frames"], s["crop_size"], s["crop_size"], generator=generator)
    keep = torch.stack([torch.randperm(vit.num_patches, generator=generator)[:KEEP] for _ in range(s["batch"])])
    with torch.no_grad():
        tensors = {"clip": clip, "keep_idx": keep, "online_tokens": vit(clip), "ema_tokens": ema(clip),
                   "online_kept_tokens": vit(clip, masks=[keep])}

    out = FIXTURES / "vjepa2_1"
    out.mkdir(parents=True, exist_ok=True)

    def ddp(state: dict) -> dict:
        return {f"module.backbone.{k}": v.clone() for k, v in state.items()}

    torch.save({"encoder": ddp(vit.state_dict()), "ema_encoder": ddp(ema.state_dict()), "epoch": 1},
               out / "checkpoint.pt")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "tensors.safetensors"))
    meta = {
        "what": "a small V-JEPA 2.1 encoder built from the reference's modules with random weights, its checkpoint "
                "in the reference's format, and its tokens; regenerate with tools/parity/vjepa2_1_fixtures.py",
        "reference": reference, "seed": SEED, "sizes": SIZES, "keep": KEEP,
        "tensors": {
            "clip": "[B, 3, T, H, W] input clip (standard normal)",
            "keep_idx": "[B, K] patches the masked forward keeps",
            "online_tokens / ema_tokens": "encoder(clip) / ema_encoder(clip): [B, N, E] (the last level's norm)",
            "online_kept_tokens": "encoder(clip, masks=[keep_idx]): [B, K, E]",
        },
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "published_shapes.json").write_text(json.dumps(published_shapes()) + "\n")
    for path in sorted(out.iterdir()):
        print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
