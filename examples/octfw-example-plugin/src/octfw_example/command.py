"""Registers one command, ``octfw npy-check FOLDER``: reads every volume of an
``npy-folder`` dataset as training would and names the files a run would quarantine.

A dataset's own step, before a run: the command belongs to the plugin, not to
octfw. The module imports only argparse and octfw's light modules (``octfw --help``
imports it); the work, numpy included, happens in ``run``.

Exit codes: 0 every volume is usable, 1 some are not (each named), 2 a mistake
in the arguments (not a folder, no spacing.json), as octfw's own commands.
"""

from __future__ import annotations

import argparse

from octfw.hookspecs import RegisterCommand, hookimpl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="folder of .npy volumes with a spacing.json beside them")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from octfw.display.errors import CorruptFile, UserError
    from octfw_example.dataset import NpyFolder, NpyFolderConfig

    folder = Path(args.folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder")  # one line on stderr, exit code 2
    dataset = NpyFolder(NpyFolderConfig(path=str(folder)), folder)
    unusable = []
    for index in range(len(dataset)):
        try:
            dataset.load(index)
        except CorruptFile as exc:
            unusable.append(f"{dataset.files[index].name}: {exc.reason}")
    print(f"{len(dataset) - len(unusable)} of {len(dataset)} volumes usable")
    for line in unusable:
        print(f"  not usable: {line}")
    return 1 if unusable else 0


@hookimpl
def octfw_register_commands(register: RegisterCommand) -> None:
    register("npy-check", add_arguments, run,
             "Read every volume of an npy-folder dataset and name the files a run would quarantine.")
