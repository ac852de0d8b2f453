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
- ``model``: the recipe's ``[model]`` table; ``checkpoint`` (its file name,
  never a local path), ``run`` (``<recipe>/<run folder>``) and
  ``update_step``: where the weights come from; ``versions`` of the run;
- ``license``, ``datasets`` and ``metrics`` (the run's evaluator results):
  what the model card states.

Every other ``--format`` records the same ``info`` (:mod:`octfw.formats`).
:func:`load_encoder` reads each of them and returns a :class:`PretrainedEncoder` in eval mode:
``encoder(volume)`` gives patch tokens ``[B, N, E]`` and
``encoder.pool(volume)`` one embedding ``[B, E]`` per volume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from octfw.errors import CorruptFile, UserError
from octfw.formats import (BUNDLE_METADATA, BUNDLE_WEIGHTS, CONFIG_FILE, DEFAULT_LICENSE, EXPORT_FORMATS,
                           FOLDER_FORMATS, FORMAT, FORMAT_VERSION, WEIGHTS_FILE, dataset_label, encoder_info,
                           is_export_folder, is_new_or_empty, write_export)
from octfw.models.vit3d import NORM_EPS, ViT3DEncoder
from octfw.recipe import Recipe, build_component
from octfw.registry import DISABLE_ENV, Registry
from octfw.storage.files import write_atomically
from octfw.tables import counted
from octfw.types import BuildContext, EncoderModel, PreparingTransform, Provenance, RecognisingDatasetConfig, Sample

__all__ = ["FORMAT", "FORMAT_VERSION", "PretrainedEncoder", "array_sample", "export_encoder",
           "embed_to_csv", "find_checkpoint", "is_export_path", "load_encoder", "open_volumes"]


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
        import tempfile

        try:
            from huggingface_hub import HfApi
            from huggingface_hub.errors import HfHubHTTPError
        except ImportError:
            raise UserError(f"push_to_hub: {repo_id}: needs the huggingface_hub package: "
                            "pip install 'octfw[hub]'") from None
        api = HfApi(token=token) if api is None else api
        with tempfile.TemporaryDirectory(prefix="octfw-push-") as temporary:
            folder = self.save_pretrained(Path(temporary) / "encoder")
            try:
                api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
                return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                                         revision=revision, commit_message=commit_message)
            except (HfHubHTTPError, OSError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise UserError(f"push_to_hub: {repo_id}: the upload failed ({type(exc).__name__}: {first})") from None

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
            folder = Path(_download(str(name_or_folder), revision, hub_options))
        return load_encoder(folder, map_location)

    def extra_repr(self) -> str:
        return f"image_size={self.image_size}, patch_size={self.patch_size}, embed_dim={self.embed_dim}"


def _download(repo_id: str, revision: str | None, options: Mapping[str, Any]) -> str:
    """The local snapshot folder of a Hub repository (from the cache when it is there)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise UserError(f"from_pretrained: {repo_id}: no such folder; loading from the Hugging Face Hub needs "
                        "the huggingface_hub package: pip install 'octfw[hub]'") from None
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, "README.md"],
                                 library_name="octfw", **options)
    except (HfHubHTTPError, LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise UserError(f"from_pretrained: {repo_id}: no such folder, and not found on the Hugging Face Hub "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


#: What :func:`open_volumes` builds when no dataset recognises the location.
DEFAULT_DATASET = "dicom"


def open_volumes(location: str | Path, registry: Registry) -> Any:
    """The volumes at ``location`` as a dataset, built through the registry like a recipe's:
    the dataset whose config recognises the location (:class:`~octfw.types.RecognisingDatasetConfig`:
    a store written by ``octfw prepare``, a raw vendor file...), else DICOM files, a folder, glob or
    manifest of them (:data:`DEFAULT_DATASET`)."""
    from octfw.storage.files import open_filesystem

    text = str(location)
    fs, root = open_filesystem(text, setting="embed")
    names = [component.name for component in registry.by_stage("dataset")
             if isinstance(component.config, RecognisingDatasetConfig) and component.config.recognises(fs, root)]
    if len(names) > 1:
        raise UserError(f"{location}: several datasets recognise it ({', '.join(names)}); "
                        f"block the plugins you do not want with {DISABLE_ENV}")
    local = text if "://" in text else str(Path(text).absolute())
    ctx = BuildContext(recipe_dir=Path.cwd(), cache_dir=Path.cwd(), run_dir=None, seed=0, registry=registry)
    return build_component(registry, "dataset", {"name": names[0] if names else DEFAULT_DATASET, "path": local},
                           ctx, str(location))


def array_sample(volume: Any, spacing: Sequence[float] | None) -> Sample:
    """A raw ``[D, H, W]`` array or tensor as a Sample; its spacing in mm is required."""
    array = volume.detach().cpu().numpy() if isinstance(volume, torch.Tensor) else np.asarray(volume)
    if array.ndim != 3:
        raise UserError(f"embed: expected a volume [D, H, W], got an array of shape {list(array.shape)} "
                        "(a prepared [B, C, D, H, W] tensor is taken as it is)")
    if spacing is None or len(spacing) != 3 or not all(float(s) > 0 for s in spacing):
        raise UserError(f"embed: an array needs spacing=(dz, dy, dx) in mm (> 0), got {spacing!r}")
    provenance = Provenance("array", "unknown", tuple(float(s) for s in spacing), tuple(array.shape))
    return Sample(array.astype(np.float32, copy=False), provenance)


def embed_to_csv(encoder: PretrainedEncoder, location: str | Path, out: str | Path, *,
                 registry: Registry, batch_size: int = 4,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """``octfw embed``: one CSV row per usable volume at ``location`` (source, domain, label,
    e0 ... e{E-1}: the pooled embedding), written atomically; a file that cannot be used is
    skipped and listed in ``<out>.quarantine.jsonl`` with the reason. Returns a summary."""
    import csv
    import io
    import json

    out = Path(out)
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist")
    dataset = open_volumes(location, registry)
    rows: list[list[Any]] = []
    quarantined: list[dict[str, str]] = []
    pending: list[tuple[Sample, np.ndarray]] = []

    def flush() -> None:
        pooled = encoder.encode_prepared([volume for _, volume in pending], pooled=True,
                                         batch_size=len(pending)).cpu().numpy()
        for (sample, _), vector in zip(pending, pooled):
            provenance = sample.provenance
            rows.append([provenance.source, provenance.domain,
                         "" if provenance.label is None else provenance.label, *map(float, vector)])
        pending.clear()

    for index in range(len(dataset)):
        try:
            sample = dataset.load(index)
            pending.append((sample, encoder.prepare(sample, registry)))
        except CorruptFile as bad:
            quarantined.append({"source": bad.url, "reason": bad.reason})
        if len(pending) == batch_size:
            flush()
        if progress is not None:
            progress(index + 1, len(dataset))
    if pending:
        flush()
    if not rows:
        raise UserError(f"{location}: none of its {counted(len(dataset), 'volume')} could be used"
                        + (f" (first: {quarantined[0]['source']}: {quarantined[0]['reason']})" if quarantined else ""))
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["source", "domain", "label", *(f"e{i}" for i in range(encoder.embed_dim))])
    writer.writerows(rows)
    write_atomically(str(out), text.getvalue().encode("utf-8"))
    quarantine_file = out.with_name(out.name + ".quarantine.jsonl")
    if quarantined:
        write_atomically(str(quarantine_file), "".join(json.dumps(q) + "\n" for q in quarantined).encode("utf-8"))
    return {"out": str(out), "volumes": len(rows), "quarantined": len(quarantined),
            "quarantine_file": str(quarantine_file) if quarantined else None, "embed_dim": encoder.embed_dim}


# --------------------------------------------------------------------------
# finding and reading the checkpoint


def find_checkpoint(source: str | Path, registry: Registry) -> tuple[str, dict[str, Any]]:
    """The checkpoint ``source`` names and its contents: a run folder gives the checkpoint
    it stands at (:func:`octfw.rundir.run_checkpoint`: its fallback copy where the final save
    failed, else the newest complete checkpoint of the checkpointer its recipe records), a file
    is read as a checkpoint. Raises UserError for anything else."""
    from octfw.storage.checkpoints import load_checkpoint

    path = Path(source)
    if path.is_dir():
        return _latest_in_run(path, registry)
    if not path.exists():
        raise UserError(f"{source}: no such run folder or checkpoint file")
    return str(path), load_checkpoint(str(path))


def _latest_in_run(run_dir: Path, registry: Registry) -> tuple[str, dict[str, Any]]:
    from octfw.recipe import load_recipe
    from octfw.rundir import run_checkpoint

    recorded = run_dir / "recipe.toml"
    if not recorded.is_file():
        raise UserError(f"{run_dir}: not a run folder (it has no recipe.toml); "
                        "give a run folder or a checkpoint file")
    recipe = load_recipe(recorded, (), registry)
    checkpointer = recipe.checkpointer.build(recipe.build_context(registry=registry, run_dir=run_dir))
    location, _ = run_checkpoint(run_dir, checkpointer)
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
    model = recipe.model.build(recipe.build_context(registry=registry, apply_init=False))  # weights: below
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"checkpoint {where}: its weights do not fit the model its recipe "
                        f"describes ({first})") from None
    return model


def _require_table(recipe: Mapping[str, Any], key: str, where: str) -> None:
    table = recipe.get(key)
    if not isinstance(table, Mapping) or "name" not in table:
        raise UserError(f"checkpoint {where}: its recorded recipe has no [{key}] table")


# --------------------------------------------------------------------------
# export and load


def export_encoder(source: str | Path, out: str | Path, registry: Registry, export_format: str = "octfw", *,
                   force: bool = False, license: str = DEFAULT_LICENSE, datasets: Sequence[str] | None = None,
                   ) -> dict[str, Any]:
    """Write the target encoder of the checkpoint ``source`` names to ``out``.

    ``export_format``: one of :data:`octfw.formats.EXPORT_FORMATS`, whose
    module says what each writes. An existing ``out`` is replaced only with
    ``force`` (a folder only if it holds an export). ``license`` and
    ``datasets`` go to the model card (datasets default to the recipe's
    ``[dataset]``); its metrics are the run's evaluator results up to the
    checkpoint, when the run logged them to ``metrics.jsonl``. Returns a
    summary: ``out``, ``format``, ``checkpoint``, ``update_step``, ``config``,
    ``parameters`` and ``metrics`` (how many results the card lists).
    """
    if export_format not in EXPORT_FORMATS:
        raise UserError(f"--format {export_format!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    check_output(out, export_format, force)
    location, encoder, info = checkpoint_encoder(source, registry, license=license, datasets=datasets)
    write_export(export_format, out, encoder, info)
    return {
        "out": str(out),
        "format": export_format,
        "checkpoint": location,
        "update_step": info["update_step"],
        "config": info["config"],
        "parameters": sum(p.numel() for p in encoder.parameters()),
        "metrics": len(info["metrics"]),
    }


def checkpoint_encoder(source: str | Path, registry: Registry, *, license: str = DEFAULT_LICENSE,
                       datasets: Sequence[str] | None = None) -> tuple[str, ViT3DEncoder, dict[str, Any]]:
    """(where the checkpoint ``source`` names is (:func:`find_checkpoint`), its target encoder,
    what an export records beside the weights (:func:`octfw.formats.encoder_info`))."""
    location, state = find_checkpoint(source, registry)
    if not isinstance(state, Mapping) or "model" not in state or "recipe" not in state:
        raise UserError(f"{location}: not an octfw training checkpoint (it lacks 'model' or 'recipe')")
    model = rebuild_model(state, location, registry)
    encoder = model.encoder if isinstance(model, EncoderModel) else None
    if not isinstance(encoder, ViT3DEncoder):
        raise UserError(f"checkpoint {location}: model {state['recipe']['model']['name']!r} has no "
                        "ViT3D target encoder (.encoder) to export")
    for key in ("transform", "model"):
        _require_table(state["recipe"], key, location)
    update_step = int(state.get("update_step", 0))
    checkpoint_folder = Path(location).parent
    run_dir = Path(source) if Path(source).is_dir() else checkpoint_folder.parent
    in_a_run = Path(source).is_dir() or checkpoint_folder.name == "checkpoints"
    metrics = evaluator_results(run_dir, state["recipe"], update_step) if in_a_run else []
    info = encoder_info(encoder.architecture(), state["recipe"], location, update_step, state.get("versions"),
                        license=license, datasets=datasets, metrics=metrics)
    return str(location), encoder, info


def check_output(out: Path, export_format: str, force: bool) -> None:
    """Refuse an ``--out`` the export cannot or, without ``force``, may not replace:
    every format refuses to overwrite silently."""
    if export_format in FOLDER_FORMATS:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out}: is a file; give a folder name for a {export_format} export")
        if not is_new_or_empty(out):
            if not force:
                raise UserError(f"--out {out}: already exists; give --force to replace it")
            if not is_export_folder(out):  # --force on a folder of other files would delete them
                raise UserError(f"--out {out}: --force replaces an earlier export only, and this folder "
                                f"holds none ({CONFIG_FILE} or configs/metadata.json)")
    elif out.is_dir():
        raise UserError(f"--out {out}: is a folder; give a file name such as encoder.pt")
    elif out.exists() and not force:
        raise UserError(f"--out {out}: already exists; give --force to replace it")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist")


def evaluator_results(run_dir: Path, recipe: Mapping[str, Any], update_step: int) -> list[dict[str, Any]]:
    """The overall metrics of the run's last evaluation at or before ``update_step``, as
    its ``jsonl`` logger wrote them (``eval/<evaluator>/<metric>``); per-domain values and
    interval bounds are left out. Empty when the run logged none or is not on this disk."""
    import json

    loggers = [dict(t) for t in recipe.get("logger") or () if isinstance(t, Mapping) and t.get("name") == "jsonl"]
    evaluators = {str(t.get("name")): dict(t) for t in recipe.get("evaluator") or () if isinstance(t, Mapping)}
    if not loggers or not evaluators:
        return []
    path = run_dir / str(loggers[0].get("filename", "metrics.jsonl"))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:  # a checkpoint outside its run folder, or a remote run: the card says no results
        return []
    last: tuple[int, dict[str, float]] | None = None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or step > update_step:
            continue
        found = {k: v for k, v in record.items()
                 if k.startswith("eval/") and k.count("/") == 2 and not k.endswith(("_ci_low", "_ci_high"))}
        if found:
            last = (step, found)
    if last is None:
        return []
    step, found = last
    results = []
    for key, value in found.items():
        _, evaluator, metric = key.split("/")
        table = evaluators.get(evaluator, {}).get("dataset")
        results.append({"evaluator": evaluator, "metric": metric, "value": float(value), "step": step,
                        "dataset": dataset_label(table) if isinstance(table, Mapping) else None})
    return results


def load_encoder(path: str | Path, map_location: str | torch.device = "cpu") -> PretrainedEncoder:
    """Rebuild an exported encoder: a :class:`PretrainedEncoder` in eval mode.

    ``path``: what ``octfw export`` writes, in any ``--format``: an ``octfw``
    or ``torchscript`` file, a ``safetensors`` or ``monai-bundle`` folder; or a run folder,
    whose encoder is the one ``octfw export RUN`` would write: of the checkpoint the run stands
    at (:func:`octfw.rundir.run_checkpoint`). ``encoder(volume)`` -> ``[B, N, E]``
    patch tokens; ``encoder.pool(volume)`` -> ``[B, E]``; ``encoder.embed(...)``
    takes volumes as users have them. Raises UserError for a missing path or
    one that is not an octfw encoder export.
    """
    path = Path(path)
    if path.is_dir() and (path / "recipe.toml").is_file():  # a run folder
        from octfw.registry import load_registry

        _, encoder, info = checkpoint_encoder(path, load_registry())
        return PretrainedEncoder(encoder, info).to(map_location).eval()
    if path.is_dir():
        data = _read_bundle(path) if (path / BUNDLE_METADATA).is_file() else _read_safetensors(path)
    elif path.is_file() and _is_torchscript(path):
        data = _read_torchscript(path)
    elif path.is_file():
        from octfw.storage.checkpoints import safe_load

        data = safe_load(str(path), str(path), what="encoder file")  # on the CPU; moved below
    else:
        raise UserError(f"{path}: no such encoder file or folder")
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise UserError(f"{path}: not an octfw encoder file or folder (write one with `octfw export`)")
    if data.get("format_version") != FORMAT_VERSION or data.get("architecture") != "vit3d":
        raise UserError(f"{path}: encoder format {data.get('format_version')!r} / architecture "
                        f"{data.get('architecture')!r} is not supported by this octfw "
                        f"(expects {FORMAT_VERSION} / 'vit3d')")
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


def _read_safetensors(folder: Path) -> dict[str, Any]:
    import json

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config.is_file() or not weights.is_file():
        raise UserError(f"{folder}: not an encoder folder (it needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                        "write one with `octfw export --format safetensors`)")
    try:
        info = json.loads(config.read_text(encoding="utf-8"))
        state_dict = load_file(str(weights))
    except (ValueError, SafetensorError) as exc:
        raise UserError(f"{folder}: cannot be read ({type(exc).__name__}: {exc})") from None
    return {**info, "state_dict": state_dict} if isinstance(info, dict) else {}


def is_export_path(path: Path) -> bool:
    """Whether ``path`` is an encoder export known without loading it: a safetensors or MONAI
    bundle folder, or a TorchScript file (an ``octfw`` file is told by its contents)."""
    return is_export_folder(path) if path.is_dir() else path.is_file() and _is_torchscript(path)


def _is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (a zip holding ``constants.pkl`` and ``code/``),
    not a ``torch.save`` file (a zip holding ``data.pkl``)."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") for name in archive.namelist())


def _read_torchscript(path: Path) -> dict[str, Any]:
    """What ``octfw export --format torchscript`` wrote: ``info`` from its ``config.json`` extra
    file, the weights from the traced module's state dict (the eager encoder's names).
    ``torch.jit.load`` runs no Python code from the file; the network is rebuilt from octfw's
    own class, so the traced graph is not used."""
    import json

    extra = {CONFIG_FILE: ""}
    try:
        module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"{path}: a TorchScript file that cannot be read ({first})") from None
    if not extra[CONFIG_FILE]:
        raise UserError(f"{path}: a TorchScript file without octfw's {CONFIG_FILE}; run it with torch.jit.load, "
                        "or give a file or folder written by `octfw export`")
    try:
        info = json.loads(extra[CONFIG_FILE])
    except ValueError as exc:
        raise UserError(f"{path}: its {CONFIG_FILE} cannot be read ({exc})") from None
    if not isinstance(info, dict):
        return {}
    # A sin-cos position embedding is derived from the geometry, kept out of octfw's state
    # dict; a learned one is a weight.
    learned = isinstance(info.get("config"), dict) and info["config"].get("position") == "learned"
    state_dict = {k: v for k, v in module.state_dict().items() if k != "pos_embed" or learned}
    return {**info, "state_dict": state_dict}


def _read_bundle(folder: Path) -> dict[str, Any]:
    """What ``octfw export --format monai-bundle`` wrote: ``info`` from ``configs/metadata.json``
    (its ``octfw`` entry), the weights from ``models/model.pt``."""
    import json

    from octfw.storage.checkpoints import safe_load

    weights = folder / BUNDLE_WEIGHTS
    if not weights.is_file():
        raise UserError(f"{folder}: a MONAI bundle without {BUNDLE_WEIGHTS}; give one written by "
                        "`octfw export --format monai-bundle`")
    try:
        metadata = json.loads((folder / BUNDLE_METADATA).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(f"{folder}: its {BUNDLE_METADATA} cannot be read ({exc})") from None
    info = metadata.get("octfw") if isinstance(metadata, dict) else None
    if not isinstance(info, dict):
        raise UserError(f"{folder}: a MONAI bundle that octfw did not write (its {BUNDLE_METADATA} has no 'octfw')")
    return {**info, "state_dict": safe_load(str(weights), str(weights), what="encoder file")}
