"""``octfw export RUN_DIR_OR_CHECKPOINT --out encoder.pt``: write the pretrained encoder."""

from __future__ import annotations

import argparse

from octfw.exports.formats import DEFAULT_LICENSE, EXPORT_FORMATS

__all__ = ["add_parser"]

HELP = ("Write the target (EMA) encoder of a run's latest checkpoint, or of a checkpoint file or a sharded "
        "checkpoint's folder, as one file or folder, "
        "with the configuration to rebuild it; load it with octfw.load_encoder(path).")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help=HELP, description=HELP)
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run folder (its latest checkpoint is used), a checkpoint file (.pt) or a sharded "
                             "checkpoint's folder (.dcp, from an fsdp run)")
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="encoder file to write, e.g. encoder.pt (a new or empty folder with --format "
                             "safetensors or monai-bundle); an existing one is refused unless --force")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --out file, or a folder holding an earlier export")
    parser.add_argument("--license", default=DEFAULT_LICENSE, metavar="ID",
                        help="the model card's licence, a Hugging Face licence id such as apache-2.0 or "
                             f"cc-by-nc-4.0 (default {DEFAULT_LICENSE}: not stated; the pretraining data's "
                             "terms decide)")
    parser.add_argument("--dataset", action="append", metavar="NAME",
                        help="a dataset the model card names, once per dataset (default: the recipe's "
                             "[dataset]: its path's last folder, else its name; never a local path)")
    parser.add_argument("--format", default=EXPORT_FORMATS[0], choices=EXPORT_FORMATS,
                        help="octfw: one file (default); safetensors: a Hugging Face Hub-style folder "
                             "(config.json, model.safetensors, README.md model card) that "
                             "PretrainedEncoder.from_pretrained reads; torchscript: one file torch.jit.load runs "
                             "without octfw; monai-bundle: a MONAI bundle folder that `python -m monai.bundle run` "
                             "runs on a DICOM, NIfTI or .npy volume without octfw, with its network and weights to "
                             "fine-tune. octfw.load_encoder, octfw embed and octfw eval read every format")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.cli.commands._common import load_registry_once
    from octfw.exports.export import export_encoder  # imports torch: only when the command runs
    from octfw.display.tables import counted

    summary = export_encoder(args.source, args.out, load_registry_once(), args.format, force=args.force,
                             license=args.license, datasets=args.dataset)
    config = summary["config"]
    print(f"exported the target encoder ({summary['format']}) of {summary['checkpoint']} (update step {summary['update_step']}) "
          f"to {summary['out']}: {summary['parameters']:,} parameters, embed_dim {config['embed_dim']}, "
          f"image_size {config['image_size']}, patch_size {config['patch_size']}; "
          f"{counted(summary['metrics'], 'evaluator result')} recorded for the model card")
    return 0
