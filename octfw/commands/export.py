"""``octfw export RUN_DIR_OR_CHECKPOINT --out encoder.pt``: write the pretrained encoder."""

from __future__ import annotations

import argparse

from octfw.formats import EXPORT_FORMATS

__all__ = ["add_parser"]

HELP = ("Write the target (EMA) encoder of a run's latest checkpoint, or of a checkpoint file, "
        "with the configuration to rebuild it; load it with octfw.load_encoder(path).")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help=HELP, description=HELP)
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run folder (its latest checkpoint is used) or a checkpoint file (.pt)")
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="encoder file to write, e.g. encoder.pt (a new or empty folder with --format "
                             "safetensors or monai-bundle)")
    parser.add_argument("--format", default=EXPORT_FORMATS[0], choices=EXPORT_FORMATS,
                        help="octfw: one file octfw.load_encoder reads (default); safetensors: a Hugging Face "
                             "Hub-style folder (config.json, model.safetensors, README.md) that "
                             "octfw.load_encoder and PretrainedEncoder.from_pretrained read; torchscript: one "
                             "file torch.jit.load runs without octfw; monai-bundle: a MONAI bundle folder that "
                             "`python -m monai.bundle run` runs without octfw")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.commands._common import load_registry_once
    from octfw.encoder import export_encoder  # imports torch: only when the command runs

    summary = export_encoder(args.source, args.out, load_registry_once(), args.format)
    config = summary["config"]
    print(f"exported the target encoder ({summary['format']}) of {summary['checkpoint']} (update step {summary['update_step']}) "
          f"to {summary['out']}: {summary['parameters']:,} parameters, embed_dim {config['embed_dim']}, "
          f"image_size {config['image_size']}, patch_size {config['patch_size']}")
    return 0
