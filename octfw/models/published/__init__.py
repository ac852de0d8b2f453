"""Start a model from published weights: ``[model] init = "PATH or Hub id"``.

A checkpoint is read without running code from it (:func:`read_checkpoint`: safetensors,
or ``torch.load(weights_only=True)``), its format is recognised by its keys, and that
format's converter copies its tensors into octfw's 3D ViT, adapting what the recipe's
input needs (:mod:`octfw.models.published.adapt`: RGB to one channel, a 2-frame tubelet
or a 2D patch inflated to the recipe's 3D patch, a position table resampled to the
recipe's grid). The published input normalisation is folded into the patch projection, or
the report says that the recipe's input differs, and a head count that cannot be the
published encoder's is refused (:mod:`octfw.models.published.inputs`). The result is an
:class:`InitReport` that ``octfw check`` prints.

Converters are one module per source format, listed in :data:`FORMATS` (name -> module);
a module has ``NAME``, ``detect(state) -> bool`` (is this checkpoint mine?) and
``convert(state, targets, report)``. :func:`register_format` adds one (the MAE-family
formats plug in beside ``vjepa2`` so). This package is light at import: torch and
huggingface_hub are imported when a checkpoint is read.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Mapping

import attrs

from octfw.display.errors import UserError
from octfw.models.published.report import InitReport

__all__ = ["FORMATS", "InitReport", "InitTargets", "register_format", "converter", "read_checkpoint",
           "resolve_source", "detect_format", "initialise"]

#: Source formats by name: the module holding each converter (imported when used).
FORMATS: dict[str, str] = {
    "vjepa2": "octfw.models.published.vjepa2",
    "vjepa2.1": "octfw.models.published.vjepa2_1",
    "videomae": "octfw.models.published.videomae",
    "mae-st": "octfw.models.published.mae_st",
    "retfound": "octfw.models.published.retfound",
}

#: A Hugging Face Hub repository id, optionally with one file of it: ``org/name`` or ``org/name:file``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w./-]+)?$")

#: Weight files looked for in a Hub repository, in this order of preference.
_WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".pth.tar", ".ckpt")


def register_format(name: str, module: str) -> None:
    """Add a converter module (``NAME``, ``detect``, ``convert``) for source format ``name``."""
    if name in FORMATS and FORMATS[name] != module:
        raise ValueError(f"format {name!r} is already converted by {FORMATS[name]}")
    FORMATS[name] = module


def converter(name: str) -> Any:
    """The converter module of format ``name``."""
    if name not in FORMATS:
        raise UserError(f"unknown checkpoint format {name!r}; octfw converts {', '.join(FORMATS)}")
    return importlib.import_module(FORMATS[name])


@attrs.frozen
class InitTargets:
    """The networks of a model that published weights go into.

    ``online``: the encoder that trains (vjepa3d's context encoder, mae3d's encoder);
    ``ema``: vjepa3d's EMA target encoder, None without one; ``predictor``: the
    :class:`~octfw.models.masked_decoder.MaskedTokenDecoder` that continues the source's
    predictor, None where the recipe does not continue it. ``prefixes``: each role's key
    prefix in the model's state dict (for the report). ``recipe``: how the recipe's network
    is named in messages.
    """

    online: Any
    ema: Any = None
    predictor: Any = None
    prefixes: Mapping[str, str] = attrs.field(factory=lambda: {"online": "encoder.", "ema": "", "predictor": ""})
    recipe: str = "the recipe's encoder"
    predictor_note: str | None = None
    #: V-JEPA 2.1's norms of the intermediate levels its dense loss predicts, by role (``online``,
    #: ``ema``; prefixes ``online_levels``, ``ema_levels``): None where the recipe has none.
    level_norms: Mapping[str, Any] | None = None
    #: The source whose predictor ``predictor`` is built after: ``"vjepa2.1"`` (V-JEPA 2.1's
    #: hierarchical predictor, ``dense_predictor = "vjepa2.1"``); None: octfw's masked-token
    #: predictor, V-JEPA 2's layout.
    predictor_format: str | None = None
    #: ``init_channels``: how an RGB patch projection meets the recipe's input, ``"sum"``,
    #: ``"fold"`` or ``"auto"`` (:func:`octfw.models.published.inputs.channel_rule`).
    channels: str = "auto"


def resolve_source(source: str, recipe_dir: Path | None = None) -> Path:
    """The local file ``source`` names: a path (relative to the recipe's folder, else the
    working folder) or a Hub id ``org/name[:file]`` found through huggingface_hub (offline
    from the local cache with ``HF_HUB_OFFLINE=1``)."""
    path = Path(source).expanduser()
    candidates = [path] if path.is_absolute() else [*(([recipe_dir / path]) if recipe_dir else []), path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    # A name with a weight file's suffix is a path that is missing, not a Hub repository.
    if not _HUB_ID.match(source) or source.startswith((".", "/")) or source.partition(":")[0].endswith(_WEIGHT_SUFFIXES):
        raise UserError(f"model.init = {source!r}: no such file (a path, relative to the recipe's folder, "
                        "or a Hugging Face Hub id org/name)")
    return _hub_file(source)


def _hub_file(source: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise UserError(f"model.init = {source!r} is a Hub id: install huggingface_hub "
                        "(pip install 'octfw[hub]')") from None
    repo, _, file = source.partition(":")
    patterns = [file] if file else [f"*{suffix}" for suffix in _WEIGHT_SUFFIXES]
    try:
        folder = Path(snapshot_download(repo, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise UserError(f"model.init = {source!r}: not in the local Hugging Face cache and the Hub cannot be "
                        "reached (HF_HUB_OFFLINE=1 reads only the cache: download it once with "
                        f"`hf download {repo}`)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise UserError(f"model.init = {source!r}: the Hub refused it ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    files = sorted(p for p in folder.rglob("*") if p.is_file() and str(p).endswith(_WEIGHT_SUFFIXES))
    if file:
        files = [p for p in files if p.relative_to(folder).as_posix() == file]
    if len(files) != 1:
        found = ", ".join(p.relative_to(folder).as_posix() for p in files) or "none"
        raise UserError(f"model.init = {source!r}: {'no' if not files else 'several'} weight files in the "
                        f"repository ({found}); name one as {repo}:FILE")
    return files[0]


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The tensors of a checkpoint file, read without running code from it: safetensors, or
    ``torch.load(weights_only=True)`` (a pickled class is refused, never executed)."""
    if path.name.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"model.init {path}: cannot be read as safetensors ({exc})") from None
    from octfw.storage.checkpoint_reading import safe_load

    return safe_load(str(path), str(path), what="model.init file")


def detect_format(state: Mapping[str, Any], path: Path) -> str:
    """The name of the format whose converter recognises ``state``."""
    for name in FORMATS:
        if converter(name).detect(state):
            return name
    keys = ", ".join(list(state)[:5])
    raise UserError(f"model.init {path}: not a checkpoint format octfw converts ({', '.join(FORMATS)}); "
                    f"its first keys: {keys}")


def initialise(source: str, targets: InitTargets, recipe_dir: Path | None = None) -> InitReport:
    """Load the published weights ``source`` into ``targets``; what was done, as a report."""
    path = resolve_source(source, recipe_dir)
    state = read_checkpoint(path)
    name = detect_format(state, path)
    report = InitReport(source=source if str(path) == source else f"{source} ({path})", format=name)
    from octfw.models.published import inputs

    rule = inputs.channel_rule(targets.channels, name, state, targets.online)
    original = state
    if rule == "fold":  # the checkpoint made a network of raw [0, 1] intensities, then converted as usual
        state, _ = inputs.fold_checkpoint(state, inputs.FAMILIES[name].normalisation)
    converter(name).convert(state, targets, report)
    inputs.refuse_heads(name, targets.online)
    if rule == "fold":
        inputs.note_fold(report, inputs.FAMILIES[name].normalisation)
    note = inputs.input_note(name, rule, original, targets.online)
    if note is not None:
        report.notes.append(note)
    return report
