"""Record MAE's reconstruction loss, with and without norm_pix_loss, for fixed tensors.

Runs the reference's own ``patchify`` and ``forward_loss``:

- facebookresearch/mae ``models_mae.MaskedAutoencoderViT`` (images, 2D): its
  blocks need timm 0.3.2, which no longer imports beside torch 2.9, so the
  model object is made without its ``__init__`` and given only what the two
  methods read (``patch_embed``, timm's ``PatchEmbed``, and ``norm_pix_loss``);
- facebookresearch/mae_st ``models_mae.MaskedAutoencoderViT`` (video, 3D),
  built at a small size with ``pred_t_dim = num_frames`` (every frame predicted).

The inputs (images or clips, predictions for every patch, a mask with the
same number of removed patches per sample) are drawn once from a seeded
generator and saved beside the losses in ``tests/fixtures/reference/mae_loss.safetensors``;
the losses and the commits go to ``mae_loss.json``.

Usage (mae and mae_st checkouts in one folder, named so; the reference's
imports in their own folder)::

    .venv/bin/python -m pip install --target /tmp/refdeps --no-deps timm torchvision==0.24.0 \\
        einops simplejson iopath fvcore portalocker tabulate termcolor yacs
    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/mae_loss.py --mae /tmp/ref/mae --mae-st /tmp/ref/mae_st
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from _reference import FIXTURES, checkout, write_fixture

BATCH, CHANNELS = 2, 3
MASKED = {"image": 11, "video": 5}  # of 16 and of 8 patches


def fixed_mask(generator: torch.Generator, patches: int, masked: int) -> torch.Tensor:
    """``[BATCH, patches]`` of 0 (kept) and 1 (removed), ``masked`` removed per sample (MAE's convention)."""
    mask = torch.zeros(BATCH, patches)
    for row in range(BATCH):
        mask[row, torch.randperm(patches, generator=generator)[:masked]] = 1.0
    return mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mae", required=True, help="a checkout of facebookresearch/mae")
    parser.add_argument("--mae-st", required=True, help="a checkout of facebookresearch/mae_st, in a folder named mae_st")
    args = parser.parse_args()
    mae_st_root = Path(args.mae_st).resolve()
    if mae_st_root.name != "mae_st":
        raise SystemExit("mae_st imports itself as the package mae_st: its folder must be named so")
    # mae last, so that `import models_mae` is its file; mae_st is imported as a package.
    references = {"mae_st": checkout("mae_st", mae_st_root), "mae": checkout("mae", args.mae)}
    sys.path.insert(1, str(mae_st_root.parent))

    import models_mae as mae2d  # facebookresearch/mae (first on sys.path after checkout())
    from mae_st.models_mae import MaskedAutoencoderViT as VideoMAE
    from timm.models.vision_transformer import PatchEmbed

    generator = torch.Generator().manual_seed(50)
    tensors, losses = {}, {}

    # -- images: 16 x 16, patch 4 -> 4 x 4 patches of 4 * 4 * 3 values
    image = mae2d.MaskedAutoencoderViT.__new__(mae2d.MaskedAutoencoderViT)
    torch.nn.Module.__init__(image)
    image.patch_embed = PatchEmbed(16, 4, CHANNELS, 8)
    tensors["image/imgs"] = torch.randn(BATCH, CHANNELS, 16, 16, generator=generator)
    tensors["image/pred"] = torch.randn(BATCH, 16, 4 * 4 * CHANNELS, generator=generator)
    tensors["image/mask"] = fixed_mask(generator, 16, MASKED["image"])
    for norm in (False, True):
        image.norm_pix_loss = norm
        loss = image.forward_loss(tensors["image/imgs"], tensors["image/pred"], tensors["image/mask"])
        losses[f"image/norm_pix_loss={norm}"] = float(loss)

    # -- clips: 4 frames of 8 x 8, tubelet 2, patch 4 -> 2 x 2 x 2 patches of 2 * 4 * 4 * 3 values
    for norm in (False, True):
        video = VideoMAE(img_size=8, patch_size=4, in_chans=CHANNELS, embed_dim=16, depth=1, num_heads=2,
                         decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, num_frames=4,
                         t_patch_size=2, pred_t_dim=4, norm_pix_loss=norm)
        if "video/imgs" not in tensors:
            tensors["video/imgs"] = torch.randn(BATCH, CHANNELS, 4, 8, 8, generator=generator)
            tensors["video/pred"] = torch.randn(BATCH, 8, 2 * 4 * 4 * CHANNELS, generator=generator)
            tensors["video/mask"] = fixed_mask(generator, 8, MASKED["video"]).reshape(BATCH * 2, 4)  # [N * t, h * w]
        loss = video.forward_loss(tensors["video/imgs"], tensors["video/pred"], tensors["video/mask"])
        losses[f"video/norm_pix_loss={norm}"] = float(loss)

    FIXTURES.mkdir(parents=True, exist_ok=True)
    tensor_file = FIXTURES / "mae_loss.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tensor_file))
    tensor_file.chmod(0o644)
    write_fixture("mae_loss.json", {
        "what": "MAE's forward_loss (mean squared error on removed patches, optionally on per-patch "
                "normalised targets) for the tensors in mae_loss.safetensors; regenerate with "
                "tools/parity/mae_loss.py",
        "references": references,
        "layout": {
            "image": "imgs [N, C, H, W] = [2, 3, 16, 16], patch 4: pred [N, 16, p*p*C] with patches "
                     "row-major over (h, w) and values over (p, q, c); mask [N, 16], 1 = removed",
            "video": "imgs [N, C, T, H, W] = [2, 3, 4, 8, 8], tubelet 2, patch 4: pred [N, 8, u*p*p*C] "
                     "with patches row-major over (t, h, w) and values over (u, p, q, c); mask "
                     "[N * t, h * w], 1 = removed",
        },
        "masked_per_sample": MASKED,
        "losses": losses,
    })


if __name__ == "__main__":
    main()
