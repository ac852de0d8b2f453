"""``octfw embed ENCODER DATA --out embeddings.csv``: one embedding per volume, as a table."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]

HELP = ("Embed every volume of DATA (a DICOM file, folder, glob or manifest, a raw vendor file, or a "
        "store written by octfw prepare) with an encoder written by octfw export (any --format), "
        "prepared as its training prepared volumes; write a CSV: source, domain, label, e0 ... e{E-1} "
        "(Python's csv module opens it). Files that cannot be used are listed beside it.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("embed", help=HELP, description=HELP)
    parser.add_argument("encoder", metavar="ENCODER", help="what octfw export wrote: an encoder file (--format octfw or torchscript) "
                             "or folder (safetensors or monai-bundle)")
    parser.add_argument("data", metavar="DATA", help="DICOM file, folder, glob or manifest; vendor file; prepared store")
    parser.add_argument("--out", required=True, metavar="FILE", help="CSV to write, e.g. embeddings.csv")
    parser.add_argument("--batch-size", type=int, default=4, metavar="N", help="volumes per forward pass (default 4)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.cli.commands._common import load_registry_once
    from octfw.exports.embed_csv import embed_to_csv  # imports torch: only when the command runs
    from octfw.exports.pretrained import load_encoder
    from octfw.display.errors import UserError
    from octfw.display.progress import progress_bar
    from octfw.display.tables import counted

    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: give 1 or more")
    encoder = load_encoder(args.encoder)
    with progress_bar("embed", unit="volumes", text="reading the file list") as progress:
        summary = embed_to_csv(encoder, args.data, args.out, registry=load_registry_once(),
                               batch_size=args.batch_size, progress=progress)
    print(f"embedded  {counted(summary['volumes'], 'volume')} -> {summary['out']} "
          f"({summary['embed_dim']} dimensions), {summary['quarantined']} quarantined")
    if summary["quarantine_file"]:
        print(f"          the files that could not be used and why: {summary['quarantine_file']}")
    return 0
