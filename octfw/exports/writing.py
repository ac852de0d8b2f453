"""Writing an exported encoder: one writer per ``octfw export --format``
(:data:`~octfw.exports.formats.EXPORT_FORMATS`; what each holds: :mod:`octfw.exports.formats`).

Every file is written atomically, and the file that makes a folder an export
(``config.json``, ``configs/metadata.json``) last: a crash leaves no folder
that loads half-written.

This module knows files, not training: it is given the encoder module, its
weights and ``info`` (what :func:`octfw.exports.export.export_encoder` or the
engine's end of run recorded), so both ``octfw export`` and the end-of-run
``RUN/encoder`` use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from octfw.exports.card import model_card
from octfw.exports.formats import (BUNDLE_METADATA, BUNDLE_NETWORK, BUNDLE_WEIGHTS, CARD_FILE, CONFIG_FILE,
                                   FOLDER_FORMATS, FORMAT, WEIGHTS_FILE, is_new_or_empty)
from octfw.exports.monai_bundle import bundle_inference_config, bundle_metadata
from octfw.storage.files import write_atomically

if TYPE_CHECKING:  # torch is imported where it is used
    import torch
    from torch import nn

__all__ = ["write_export"]


def write_export(export_format: str, out: Path, encoder: nn.Module, info: Mapping[str, Any]) -> None:
    """Write ``encoder`` (a ViT3D encoder: ``[B, C, D, H, W]`` -> ``[B, N, E]``) to ``out``.

    A folder format is written into a hidden sibling folder first and renamed
    onto ``out`` (new or empty) when complete: a failed export leaves nothing.
    """
    import torch

    weights = {k: v.detach().cpu().contiguous().clone() for k, v in encoder.state_dict().items()}
    if export_format == "octfw":
        write_atomically(out, lambda f: torch.save({**info, "state_dict": weights}, f))
    elif export_format == "torchscript":
        _write_torchscript(out, encoder, info)
    elif export_format in FOLDER_FORMATS:
        with _folder_in_place(out) as folder:
            if export_format == "safetensors":
                _write_safetensors_folder(folder, weights, info)
            else:
                _write_monai_bundle(folder, encoder, weights, info)
    else:  # the caller checked the name against EXPORT_FORMATS
        raise ValueError(f"unknown export format {export_format!r}")


@contextlib.contextmanager
def _folder_in_place(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out``, renamed onto it if the block succeeds, else removed.
    A non-empty ``out`` is replaced only then (kept, if the block fails)."""
    token = uuid.uuid4().hex[:8]
    temporary, previous = out.parent / f".tmp-{out.name}-{token}", out.parent / f".old-{out.name}-{token}"
    temporary.mkdir()
    try:
        yield temporary
        if not is_new_or_empty(out):
            os.replace(out, previous)
        os.replace(temporary, out)  # rename(2) replaces an empty folder
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.rmtree(previous, ignore_errors=True)


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, default=str) + "\n").encode("utf-8")


def _write_safetensors_folder(folder: Path, weights: Mapping[str, torch.Tensor],
                              info: Mapping[str, Any]) -> None:
    """The Hub layout: model card, weights, then ``config.json`` last."""
    from safetensors.torch import save

    folder.mkdir(parents=True, exist_ok=True)
    parameters = sum(t.numel() for t in weights.values())
    write_atomically(folder / CARD_FILE, model_card(info, parameters).encode("utf-8"))
    write_atomically(folder / WEIGHTS_FILE, save(dict(weights), metadata={"format": FORMAT}))
    write_atomically(folder / CONFIG_FILE, _json(info))


def _traced(encoder: nn.Module) -> torch.jit.ScriptModule:
    import torch

    config = encoder.architecture()
    example = torch.zeros(1, config["in_channels"], *config["image_size"])
    with torch.no_grad():
        return torch.jit.trace(encoder.eval(), example)


def _write_torchscript(out: Path, encoder: nn.Module, info: Mapping[str, Any]) -> None:
    import torch

    extra = {CONFIG_FILE: json.dumps(info, default=str)}
    traced = _traced(encoder)
    write_atomically(out, lambda f: torch.jit.save(traced, f, _extra_files=extra))


def _write_monai_bundle(folder: Path, encoder: nn.Module, weights: Mapping[str, torch.Tensor],
                        info: Mapping[str, Any]) -> None:
    """The bundle: the network's source and weights, the TorchScript file, the model card,
    the inference config, then ``configs/metadata.json`` last."""
    import inspect

    import torch

    for sub in ("configs", "models", "docs", "scripts"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    # The encoder's module, copied as it is: it imports torch only, so the bundle
    # defines the network without octfw (tests/test_embed.py loads it so).
    write_atomically(folder / BUNDLE_NETWORK, Path(inspect.getfile(type(encoder))).read_bytes())
    write_atomically(folder / BUNDLE_WEIGHTS, lambda f: torch.save(dict(weights), f))
    _write_torchscript(folder / "models" / "model.ts", encoder, info)
    parameters = sum(p.numel() for p in encoder.parameters())
    write_atomically(folder / "docs" / "README.md", model_card(info, parameters).encode("utf-8"))
    write_atomically(folder / "configs" / "inference.json", _json(bundle_inference_config(info)))
    write_atomically(folder / BUNDLE_METADATA, _json(bundle_metadata(info)))
