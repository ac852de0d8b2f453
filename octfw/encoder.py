"""Export the pretrained encoder of a run, and load it back in one call.

``octfw export RUN_DIR_OR_CHECKPOINT --out encoder.pt`` reads a training
checkpoint, rebuilds the model its recorded recipe describes, and writes the
target (EMA) encoder: the network V-JEPA keeps after pretraining. The file is
a plain dict that ``torch.load(weights_only=True)`` reads:

- ``format`` (``"octfw-encoder"``), ``format_version``, ``octfw_version``;
- ``architecture`` (``"vit3d"``) and ``config``: the arguments of
  :class:`octfw.models.vit3d.ViT3DEncoder` (``image_size``, ``patch_size``,
  ``in_channels``, ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``);
- ``state_dict``: the encoder weights (CPU tensors);
- ``transform``: the recipe's ``[transform]`` table, for reference: inputs
  should be prepared the same way (spacing, intensity percentiles, size);
- ``model``: the recipe's ``[model]`` table; ``checkpoint`` and
  ``update_step``: where the weights come from; ``versions`` of the run.

:func:`load_encoder` returns a :class:`PretrainedEncoder` in eval mode:
``encoder(volume)`` gives patch tokens ``[B, N, E]`` and
``encoder.pool(volume)`` one embedding ``[B, E]`` per volume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from octfw.errors import UserError
from octfw.models.vit3d import ViT3DEncoder
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.storage.files import write_atomically

__all__ = ["FORMAT", "FORMAT_VERSION", "PretrainedEncoder", "export_encoder", "find_checkpoint",
           "load_encoder"]

FORMAT = "octfw-encoder"
FORMAT_VERSION = 1


class PretrainedEncoder(nn.Module):
    """A pretrained 3D ViT encoder that embeds a volume in one call.

    ``forward(volume [B, C, D, H, W]) -> [B, N, E]``: one token per patch, in
    row-major order over the patch grid. :meth:`pool` averages them into one
    ``[B, E]`` embedding per volume. ``info`` holds everything the export file
    recorded except the weights (``config``, ``transform``, ``checkpoint``...).
    """

    def __init__(self, encoder: ViT3DEncoder, info: Mapping[str, Any]):
        super().__init__()
        self.encoder = encoder
        self.info = dict(info)

    @property
    def image_size(self) -> tuple[int, int, int]:
        return self.encoder.image_size

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return self.encoder.patch_size

    @property
    def in_channels(self) -> int:
        return self.encoder.in_channels

    @property
    def embed_dim(self) -> int:
        return self.encoder.embed_dim

    @property
    def grid_size(self) -> tuple[int, int, int]:
        return self.encoder.grid_size

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        expected = (self.in_channels, *self.image_size)
        if volume.dim() != 5 or tuple(volume.shape[1:]) != expected:
            raise ValueError(
                f"expected a volume [B, {', '.join(map(str, expected))}] (B, C, D, H, W), "
                f"got {list(volume.shape)}; prepare it like the transform in encoder.info['transform']"
            )
        return self.encoder(volume)

    def pool(self, volume: torch.Tensor) -> torch.Tensor:
        """One embedding per volume: the mean of its patch tokens, ``[B, E]``."""
        return self(volume).mean(dim=1)

    def extra_repr(self) -> str:
        return f"image_size={self.image_size}, patch_size={self.patch_size}, embed_dim={self.embed_dim}"


# --------------------------------------------------------------------------
# finding and reading the checkpoint


def find_checkpoint(source: str | Path, registry: Registry) -> tuple[str, dict[str, Any]]:
    """The checkpoint ``source`` names and its contents: a run folder gives its
    latest complete checkpoint (through the checkpointer its recipe records),
    a file is read as a checkpoint. Raises UserError for anything else."""
    from octfw.storage.checkpoints import load_checkpoint

    path = Path(source)
    if path.is_dir():
        return _latest_in_run(path, registry)
    if not path.exists():
        raise UserError(f"{source}: no such run folder or checkpoint file")
    return str(path), load_checkpoint(str(path))


def _latest_in_run(run_dir: Path, registry: Registry) -> tuple[str, dict[str, Any]]:
    from octfw.recipe import load_recipe

    recorded = run_dir / "recipe.toml"
    if not recorded.is_file():
        raise UserError(f"{run_dir}: not a run folder (it has no recipe.toml); "
                        "give a run folder or a checkpoint file")
    recipe = load_recipe(recorded, (), registry)
    checkpointer = recipe.checkpointer.build(recipe.build_context(registry=registry, run_dir=run_dir))
    location = checkpointer.latest()
    if location is None:
        raise UserError(f"{run_dir}: no complete checkpoint found "
                        f"(checkpointer {recipe.checkpointer.name!r})")
    return location, checkpointer.load(location)


def recorded_recipe(state: Mapping[str, Any], where: str, registry: Registry) -> Recipe:
    """The recipe a checkpoint carries (every option resolved when it was saved), validated again."""
    from octfw.errors import RecipeError
    from octfw.recipe import validate

    recipe = state.get("recipe")
    if not isinstance(recipe, Mapping) or "model" not in recipe or "transform" not in recipe:
        raise UserError(f"{where}: the checkpoint records no recipe with [model] and [transform]")
    try:
        return validate(recipe, registry, Path(where))
    except RecipeError as exc:
        raise UserError(f"checkpoint {where}: its recorded recipe no longer validates: "
                        + "; ".join(exc.problems)) from None


def rebuild_model(state: Mapping[str, Any], where: str, registry: Registry) -> nn.Module:
    """The model the checkpoint's recipe describes, with the checkpoint's weights."""
    recipe = recorded_recipe(state, where, registry)
    model = recipe.model.build(recipe.build_context(registry=registry))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"checkpoint {where}: its weights do not fit the model its recipe "
                        f"describes ({first})") from None
    return model


def _table(recipe: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    table = recipe.get(key)
    if not isinstance(table, Mapping) or "name" not in table:
        raise UserError(f"checkpoint {where}: its recorded recipe has no [{key}] table")
    return dict(table)


# --------------------------------------------------------------------------
# export and load


def export_encoder(source: str | Path, out: str | Path, registry: Registry) -> dict[str, Any]:
    """Write the target encoder of the checkpoint ``source`` names to ``out``.

    Returns a summary: ``out``, ``checkpoint``, ``update_step``, ``config``
    and ``parameters`` (the encoder's parameter count).
    """
    from octfw.version import __version__

    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out}: is a folder; give a file name such as encoder.pt")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist")
    location, state = find_checkpoint(source, registry)
    if not isinstance(state, Mapping) or "model" not in state or "recipe" not in state:
        raise UserError(f"{location}: not an octfw training checkpoint (it lacks 'model' or 'recipe')")
    model = rebuild_model(state, location, registry)
    encoder = getattr(model, "encoder", None)
    if not isinstance(encoder, ViT3DEncoder):
        raise UserError(f"checkpoint {location}: model {state['recipe']['model']['name']!r} has no "
                        "ViT3D target encoder (.encoder) to export")
    exported = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "octfw_version": __version__,
        "architecture": "vit3d",
        "config": encoder.architecture(),
        "state_dict": {k: v.detach().cpu().clone() for k, v in encoder.state_dict().items()},
        "transform": _table(state["recipe"], "transform", location),
        "model": _table(state["recipe"], "model", location),
        "checkpoint": str(location),
        "update_step": int(state.get("update_step", 0)),
        "versions": state.get("versions"),
    }
    write_atomically(out, lambda f: torch.save(exported, f))
    return {
        "out": str(out),
        "checkpoint": str(location),
        "update_step": exported["update_step"],
        "config": exported["config"],
        "parameters": sum(p.numel() for p in encoder.parameters()),
    }


def load_encoder(path: str | Path, map_location: str | torch.device = "cpu") -> PretrainedEncoder:
    """Rebuild an exported encoder: a :class:`PretrainedEncoder` in eval mode.

    ``encoder(volume)`` -> ``[B, N, E]`` patch tokens; ``encoder.pool(volume)``
    -> ``[B, E]``. Raises UserError for a missing file or one that is not an
    octfw encoder export.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such encoder file")
    from octfw.storage.checkpoints import safe_load

    data = safe_load(str(path), str(path), what="encoder file")  # on the CPU; moved below
    if data.get("format") != FORMAT:
        raise UserError(f"{path}: not an octfw encoder file (write one with `octfw export`)")
    if data.get("format_version") != FORMAT_VERSION or data.get("architecture") != "vit3d":
        raise UserError(f"{path}: encoder format {data.get('format_version')!r} / architecture "
                        f"{data.get('architecture')!r} is not supported by this octfw "
                        f"(expects {FORMAT_VERSION} / 'vit3d')")
    config = data["config"]
    encoder = ViT3DEncoder(
        tuple(config["image_size"]), tuple(config["patch_size"]), config["in_channels"],
        config["embed_dim"], config["depth"], config["num_heads"], config["mlp_ratio"],
    )
    encoder.load_state_dict(data["state_dict"])
    info = {k: v for k, v in data.items() if k != "state_dict"}
    return PretrainedEncoder(encoder, info).to(map_location).eval()
