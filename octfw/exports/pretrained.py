"""An exported encoder in Python: :class:`PretrainedEncoder` and :func:`load_encoder`.

:func:`load_encoder` reads every format ``octfw export`` writes (:mod:`octfw.exports.reading`),
or a run folder's checkpoint (:mod:`octfw.exports.checkpoint`), and returns a
:class:`PretrainedEncoder` in eval mode: ``encoder(volume)`` gives patch tokens ``[B, N, E]``,
``encoder.pool(volume)`` one embedding ``[B, E]`` per volume, and ``encoder.embed(...)``
takes volumes as users have them (:mod:`octfw.exports.volumes`), prepared as in training.
``save_pretrained``, ``push_to_hub`` and ``from_pretrained`` go to and from a Hub-style
folder (:mod:`octfw.exports.hub`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from octfw.display.errors import CorruptFile, UserError
from octfw.exports.checkpoint import checkpoint_encoder
from octfw.exports.formats import CONFIG_FILE, is_export_folder, is_new_or_empty
from octfw.exports.hub import download, upload
from octfw.exports.reading import read_export
from octfw.exports.volumes import array_sample, open_volumes
from octfw.exports.writing import write_export
from octfw.models.vit3d import NORM_EPS, ViT3DEncoder
from octfw.recipe import build_component
from octfw.registry import Registry
from octfw.types import BuildContext, PreparingTransform, Sample

__all__ = ["PretrainedEncoder", "load_encoder", "encoder_from_config"]


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
        self._transform: Any = None  # built on the first embed()

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

    # --- volumes as users have them ----------------------------------------

    def embed(self, data: Any, spacing: Sequence[float] | None = None, *, pooled: bool = False,
              batch_size: int = 4, registry: Registry | None = None) -> torch.Tensor:
        """Embed volumes as you have them, prepared as this encoder's training prepared its own.

        ``data``: a DICOM file, a raw vendor file (.e2e, .fds, .fda, .img, .OCT),
        a folder, glob or manifest of DICOM files, a numpy array or tensor
        ``[D, H, W]`` of raw intensities with its ``spacing`` (dz, dy, dx) in mm,
        or a list of these. The exported ``[transform]`` resamples, normalises
        and fits each volume (``info['transform']``). A tensor ``[B, C, D, H, W]``
        at the encoder's size is taken as prepared already. Returns the patch
        tokens ``[N, T, E]`` (as a pretraining model's ``embed`` does, so the
        evaluators take either) or, with ``pooled``, their mean ``[N, E]``; one
        row per volume, in order. A file that cannot be used raises UserError.
        """
        if isinstance(data, torch.Tensor) and data.dim() == 5:  # prepared: [B, C, D, H, W]
            with torch.no_grad():
                return self.pool(data) if pooled else self(data)
        prepared = [self.prepare(sample, registry) for sample in self.samples(data, spacing, registry)]
        if not prepared:
            raise UserError("embed: no volume given")
        return self.encode_prepared(prepared, pooled=pooled, batch_size=batch_size)

    def encode_prepared(self, prepared: Sequence[np.ndarray], *, pooled: bool, batch_size: int = 4) -> torch.Tensor:
        """Tokens ``[N, T, E]`` (or, ``pooled``, ``[N, E]``) of volumes :meth:`prepare` returned,
        ``batch_size`` at a time on the encoder's device."""
        device = next(self.parameters()).device
        out = []
        with torch.no_grad():
            for start in range(0, len(prepared), batch_size):
                batch = torch.from_numpy(np.stack(prepared[start:start + batch_size])).to(device)
                out.append(self.pool(batch) if pooled else self(batch))
        return torch.cat(out)

    def samples(self, data: Any, spacing: Sequence[float] | None = None,
                registry: Registry | None = None) -> Iterator[Sample]:
        """The raw volumes of ``data`` (see :meth:`embed`), one :class:`~octfw.types.Sample` each."""
        items = data if isinstance(data, (list, tuple)) else [data]
        for item in items:
            if isinstance(item, (str, Path)):
                dataset = open_volumes(item, registry or self._registry())
                for index in range(len(dataset)):
                    try:
                        yield dataset.load(index)
                    except CorruptFile as bad:
                        raise UserError(f"embed: {bad.url}: {bad.reason}") from None
            else:
                yield array_sample(item, spacing)

    def prepare(self, sample: Sample, registry: Registry | None = None) -> np.ndarray:
        """``[C, D, H, W]`` float32: ``sample`` as the encoder's training transform prepared volumes."""
        if self._transform is None:
            self._transform = self._build_transform(registry or self._registry())
        volume = np.asarray(self._transform.prepare(sample), dtype=np.float32)
        return volume[None] if volume.ndim == 3 else volume

    def _registry(self) -> Registry:
        from octfw.registry import load_registry

        return load_registry()

    def _build_transform(self, registry: Registry) -> Any:
        table = dict(self.info.get("transform") or {})
        if not table:
            raise UserError("embed: this export records no [transform]; prepare volumes yourself and call "
                            "the encoder on [B, C, D, H, W] tensors")
        table["cache"] = False  # one-off embedding: nothing to keep on disk
        ctx = BuildContext(recipe_dir=Path.cwd(), cache_dir=Path.cwd(), run_dir=None, seed=0,
                           image_size=self.image_size, patch_size=self.patch_size,
                           in_channels=self.in_channels, registry=registry)
        transform = build_component(registry, "transform", table, ctx, "the exported [transform]")
        if not isinstance(transform, PreparingTransform):
            raise UserError(f"embed: transform {table.get('name')!r} has no deterministic prepare()")
        return transform

    # --- the Hugging Face Hub layout ----------------------------------------

    def save_pretrained(self, folder: str | Path, *, force: bool = False) -> Path:
        """Write this encoder as a Hub-style folder (``config.json``, ``model.safetensors``,
        ``README.md``), as ``octfw export --format safetensors`` does; returns the folder.
        An existing folder is replaced only with ``force``, and only if it holds an export.
        :meth:`push_to_hub` uploads it."""
        folder = Path(folder)
        if not is_new_or_empty(folder):
            if not force:
                raise UserError(f"save_pretrained: {folder}: already exists; pass force=True to replace it")
            if not is_export_folder(folder):
                raise UserError(f"save_pretrained: {folder}: force=True replaces an earlier export only, "
                                f"and this folder holds none ({CONFIG_FILE})")
        folder.parent.mkdir(parents=True, exist_ok=True)
        write_export("safetensors", folder, self.encoder, self.info)
        return folder

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    revision: str | None = None, commit_message: str = "Upload octfw encoder",
                    api: Any = None) -> Any:
        """Upload this encoder to the Hugging Face Hub repository ``repo_id`` (``"org/name"``,
        created if missing) as :meth:`save_pretrained` writes it; :meth:`from_pretrained`
        reads it back. Returns what ``upload_folder`` returns (a ``CommitInfo``, whose text is
        the commit's URL). Needs ``huggingface_hub`` (the ``hub`` extra) and a token with write
        access (``token``, ``HF_TOKEN`` or ``huggingface-cli login``).

        ``api``: the client, ``huggingface_hub.HfApi(token=token)`` by default. Tested offline
        only (tests/test_embed.py): a stand-in ``api`` stores the upload as the Hub cache
        lays out a download, ``from_pretrained`` reads it back, and each call is checked
        against the signature of ``HfApi.create_repo`` and ``HfApi.upload_folder`` of the
        installed huggingface_hub. An upload to the real Hub is not tested.
        """
        return upload(self, repo_id, private=private, token=token, revision=revision,
                      commit_message=commit_message, api=api)

    @classmethod
    def from_pretrained(cls, name_or_folder: str | Path, *, revision: str | None = None,
                        map_location: str | torch.device = "cpu", **hub_options: Any) -> "PretrainedEncoder":
        """Load a folder written by :meth:`save_pretrained` (or ``octfw export --format
        safetensors``), or a Hugging Face Hub repository ``"org/name"`` holding one, downloaded
        through ``huggingface_hub`` (the ``hub`` extra) and its cache: ``HF_HUB_OFFLINE=1`` or
        ``local_files_only=True`` reads the cache only. ``hub_options`` go to
        ``huggingface_hub.snapshot_download`` (``cache_dir``, ``token``, ...)."""
        folder = Path(name_or_folder)
        if not folder.is_dir():
            folder = Path(download(str(name_or_folder), revision, hub_options))
        return load_encoder(folder, map_location)

    def extra_repr(self) -> str:
        return f"image_size={self.image_size}, patch_size={self.patch_size}, embed_dim={self.embed_dim}"


def load_encoder(path: str | Path, map_location: str | torch.device = "cpu") -> PretrainedEncoder:
    """Rebuild an exported encoder: a :class:`PretrainedEncoder` in eval mode.

    ``path``: what ``octfw export`` writes, in any ``--format``: an ``octfw``
    or ``torchscript`` file, a ``safetensors`` or ``monai-bundle`` folder; or a run folder,
    whose encoder is the one ``octfw export RUN`` would write: of the checkpoint the run stands
    at (:func:`octfw.runs.checkpoint.run_checkpoint`). ``encoder(volume)`` -> ``[B, N, E]``
    patch tokens; ``encoder.pool(volume)`` -> ``[B, E]``; ``encoder.embed(...)``
    takes volumes as users have them. Raises UserError for a missing path or
    one that is not an octfw encoder export.
    """
    path = Path(path)
    if path.is_dir() and (path / "recipe.toml").is_file():  # a run folder
        from octfw.registry import load_registry

        _, encoder, info = checkpoint_encoder(path, load_registry())
        return PretrainedEncoder(encoder, info).to(map_location).eval()
    data = read_export(path)
    encoder = encoder_from_config(data["config"])
    encoder.load_state_dict(data["state_dict"])
    info = {k: v for k, v in data.items() if k != "state_dict"}
    return PretrainedEncoder(encoder, info).to(map_location).eval()


def encoder_from_config(config: Mapping[str, Any]) -> ViT3DEncoder:
    """A freshly initialised encoder of an export's ``config`` (``architecture()`` as recorded)."""
    return ViT3DEncoder(
        tuple(config["image_size"]), tuple(config["patch_size"]), config["in_channels"],
        config["embed_dim"], config["depth"], config["num_heads"], config["mlp_ratio"],
        # Encoders exported before the option existed were trained on unstandardised inputs.
        standardise_input=config.get("standardise_input", False),
        # Recorded only where they differ from the defaults (published weights: V-JEPA 2's RoPE).
        position=config.get("position", "sincos"),
        norm_eps=config.get("norm_eps", NORM_EPS),
        rope_span=config.get("rope_span"),
    )
