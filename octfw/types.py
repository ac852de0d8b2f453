"""The contracts between stages: what each component receives and returns.

These types are light (attrs, dataclasses and typing only) so that listing and validating
recipes never imports torch. Shapes are written ``[B, C, D, H, W]``: batch,
channels, depth (B-scans), height (axial), width.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np
    import torch

__all__ = [
    "Sample",
    "Provenance",
    "ModelOutput",
    "BuildContext",
    "Dataset",
    "SourcedDataset",
    "TransformCheckingDataset",
    "RecognisingDatasetConfig",
    "LabelledDataset",
    "PatientDataset",
    "MaskedDataset",
    "NamingDataset",
    "Transform",
    "PreparingTransform",
    "MaskPreparingTransform",
    "Model",
    "EMAModel",
    "ParamGroupsModel",
    "EmbeddingModel",
    "EncoderModel",
    "ExportableEncoder",
    "CountingModel",
    "ActivationCheckpointing",
    "Schedule",
    "WarmupSchedule",
    "Guard",
    "GuardInputs",
    "Stateful",
    "Logger",
    "StepListener",
    "Checkpointer",
    "ListingCheckpointer",
    "ClaimingCheckpointer",
    "CancellableCheckpointer",
    "LocatedCheckpointer",
    "Evaluator",
    "RefittingEvaluator",
    "ComparingEvaluator",
    "STAGE_PROTOCOLS",
    "OPTIONAL_PROTOCOLS",
    "protocol_members",
    "provides",
    "missing_members",
    "StopTraining",
    "TrainingDone",
    "BATCH_KEYS",
    "STORED_VIEW_DTYPES",
    "mask_keys",
    "MaskingConfig",
    "BatchKey",
    "UINT8_SCALE",
    "bytes_to_intensity",
]

#: The batch octfw's built-in transform makes and its built-in models consume
#: (each transform declares its own in :meth:`Transform.batch_spec`, each model
#: what it reads in :attr:`Model.inputs`):
#:
#: - ``context``: float32 ``[C, D, H, W]``, the view the context encoder sees.
#: - ``target``: float32 ``[C, D, H, W]``, the view the target encoder sees.
#:
#: A view may also travel as stored (:data:`STORED_VIEW_DTYPES`): a volume
#: ``octfw prepare`` stored as uint8 (each byte ``b`` meaning ``b / 255``) or
#: float16, and not augmented, goes through the loader workers and onto the
#: device in a quarter or a half of float32's bytes, and the engine converts
#: it there (``octfw.engine.data.float_views``, exactly what ``prepare()``
#: gives) before the model sees it: a model always receives float32.
#: - ``context_idx``: int64 ``[N_context]``, indices of visible patches.
#: - ``target_idx``: int64 ``[N_target]``, indices of masked patches.
#:
#: A mask with several configurations (V-JEPA's short- and long-range blocks)
#: makes one such pair per configuration, under the names :func:`mask_keys`
#: gives (``context_idx_short``, ``target_idx_short``, ...); the pairs are named
#: in :attr:`BuildContext.mask_pairs`. Patch indices count patches in row-major order over the patch grid
#: ``(D / pd, H / ph, W / pw)``. The counts are the same for every sample so
#: that an XLA graph compiles once; a ``[D, H, W]`` voxel mask is refused.
BATCH_KEYS = ("context", "target", "context_idx", "target_idx")
#: The dtypes a view may travel in besides float32: how ``octfw prepare`` stores voxels.
STORED_VIEW_DTYPES = ("uint8", "float16")


def mask_keys(pair: str) -> tuple[str, str]:
    """The batch keys ``(context_idx, target_idx)`` of the mask configuration ``pair``
    (``""``: the single pair of a one-configuration mask)."""
    suffix = f"_{pair}" if pair else ""
    return f"context_idx{suffix}", f"target_idx{suffix}"


@attrs.frozen
class BatchKey:
    """One array a transform returns per sample, as the batch carries it (declared in
    :meth:`Transform.batch_spec`): collate, the transfer to the device, SPMD sharding and
    ``octfw check`` read the declaration, so a new key needs no engine change.

    ``view``: an image the model reads as float32. It may travel as stored (uint8, each
    byte ``b`` meaning ``b * UINT8_SCALE``, or float16), converted on the device; a view that is the
    same array as an earlier view of the sample (nothing augmented it) travels once.
    Every key is split along the batch dimension over the devices (SPMD)."""

    shape: tuple[int, ...]  #: per sample, without the batch dimension (fixed: one XLA graph)
    dtype: str  #: numpy dtype name as returned ("float32", "int64"); a view may also come as stored
    view: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)


#: A uint8 view's (and a uint8 stored volume's) byte ``b`` is the intensity ``b * UINT8_SCALE``.
UINT8_SCALE = 1.0 / 255.0


def bytes_to_intensity(stored: "np.ndarray") -> "np.ndarray":
    """uint8 voxels (``b``) as float32 intensities ``b * UINT8_SCALE``, in one float32 array:
    what ``octfw prepare`` stored and what the engine's uint8 views mean."""
    import numpy as np  # here, not at import: octfw list and recipe validation import this module

    volume = stored.astype(np.float32)
    volume *= np.float32(UINT8_SCALE)  # in place: one float32 volume, not two
    return volume


def dequantize(stored: "np.ndarray") -> "np.ndarray":
    """Voxels as ``octfw prepare`` stored them (uint8 or float16) as float32 in [0, 1]
    (a float32 array as it is, without a copy): the prepared dataset's and every
    transform's one reading of a stored volume."""
    import numpy as np

    if stored.dtype == np.uint8:
        return bytes_to_intensity(stored)
    return np.asarray(stored, dtype=np.float32)
#: Added by the engine beside :data:`BATCH_KEYS`: each sample's domain as an
#: int64 index into the run's sorted domain names. It rides to the device with
#: the batch, so per-domain losses cost no host-to-device copy per step.
DOMAIN_ID_KEY = "domain_id"


@attrs.frozen
class Provenance:
    """Where a sample came from. Carries no patient identifier, ever."""

    source: str  #: URL of the file (or of the series folder)
    domain: str  #: cohort domain, usually the device manufacturer
    spacing: tuple[float, float, float]  #: (dz, dy, dx) in mm
    original_shape: tuple[int, ...]  #: shape of the volume as stored
    label: int | None = None  #: optional class label for evaluation


@attrs.frozen(eq=False)
class Sample:
    """One volume as a dataset yields it: float32 ``[D, H, W]`` plus provenance."""

    volume: "np.ndarray"
    provenance: Provenance
    #: Set by a dataset of already prepared volumes (``prepared``): the
    #: ``cache_key()`` of the transform that prepared ``volume``. A transform
    #: with that key returns the volume from ``prepare`` unchanged (as
    #: float32). ``volume`` is then as stored: uint8 (``b / 255``) or float16.
    prepared_key: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """What a model's ``forward`` returns. Every field is a device tensor.

    Reading any field on the host forces a device-to-host sync; the engine
    does so only on log steps.

    A frozen dataclass rather than attrs: ``torch.compile`` (dynamo) traces a
    dataclass's ``__init__``, but not the ``object.__setattr__.__get__`` of a
    frozen attrs class, where it broke the graph at the end of every model's
    ``forward`` (``tests/test_compile.py``).
    """

    loss: "torch.Tensor"  #: scalar float32, the value that is back-propagated
    per_sample_loss: "torch.Tensor"  #: float32 ``[B]``, for per-domain logging
    metrics: Mapping[str, "torch.Tensor"] = dataclasses.field(default_factory=dict)  #: scalars
    #: Optional float32 square matrix: the Gram matrix of a fixed-size sample of the exported
    #: network's tokens (:func:`octfw.models.health.rank_gram`). The engine copies it to the
    #: host on log steps only and logs its RankMe (``rankme``, ``rankme_max``), a decomposition
    #: the device should not do every step.
    health_gram: "torch.Tensor | None" = None


@attrs.frozen
class BuildContext:
    """What a component factory may know about the run it is built for."""

    recipe_dir: Path  #: folder of the recipe; relative paths were resolved against it
    cache_dir: Path  #: persistent cache shared between runs (decoded volumes)
    run_dir: Path | None  #: this run's directory; None in ``check`` and ``list``
    seed: int
    rank: int = 0
    world_size: int = 1
    #: Patch grid geometry: the transform's ``image_size`` [D, H, W] and the
    #: model's ``patch_size`` [pd, ph, pw]; None when a component lacks them.
    image_size: tuple[int, int, int] | None = None
    patch_size: tuple[int, int, int] | None = None
    in_channels: int = 1
    #: The transform's mask configurations (:class:`MaskingConfig`), each a context/target
    #: pair of batch keys (:func:`mask_keys`) a masked model reads; ``("",)``: one pair.
    mask_pairs: tuple[str, ...] = ("",)
    base_lr: float = 0.0
    weight_decay: float = 0.0
    #: Total update steps of the run, derived once from the dataset size,
    #: batch, world size, accumulation and epochs (or ``run.max_steps``).
    total_update_steps: int = 0
    #: The full recipe as plain data, for components that record it.
    recipe: Mapping[str, Any] = attrs.field(factory=dict)
    #: The command's :class:`octfw.registry.Registry`, for components that
    #: build components of their own (an evaluator's labelled dataset).
    registry: Any = None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


class StopTraining(Exception):
    """Raised by a guard or logger at a log step to end the run because something is wrong.

    The final checkpoint is written; the summary's ``stopped`` holds the
    message and ``octfw run`` exits 1 (``octfw.train`` raises
    :class:`octfw.errors.RunNotFinished`).
    """


class TrainingDone(StopTraining):
    """Raised by a guard or logger at a log step to end the run as finished (a target reached).

    The final checkpoint is written; the summary's ``finished_early`` holds
    the message, ``stopped`` stays empty, and the run counts as done: exit 0,
    and ``--resume auto`` does not train it again.
    """


if TYPE_CHECKING:  # pragma: no cover - a checker sees a plain metaclass
    _TypingProtocolMeta = type
else:
    _TypingProtocolMeta = type(Protocol)  # typing's metaclass of every Protocol, on every Python


class _CapabilityMeta(_TypingProtocolMeta):
    """The metaclass of octfw's protocols: ``isinstance(component, Protocol)`` looks each
    member up as the code that then uses it does, with ``getattr``, on every Python.

    Python 3.12 changed how ``isinstance`` checks a ``runtime_checkable`` protocol: it looks
    members up with ``inspect.getattr_static`` (the instance's and the classes' ``__dict__``),
    which never calls ``__getattr__``. A ``torch.nn.Module`` keeps its submodules,
    parameters and buffers in ``_modules``, ``_parameters`` and ``_buffers`` and serves them
    through ``__getattr__``, so on 3.12 and later a model whose ``encoder`` is a submodule
    (``mae3d``) was no :class:`EncoderModel`: its run ended without ``RUN/encoder`` and said
    nothing, and ``octfw export`` and the fine-tune evaluators refused it (``vjepa3d``'s
    ``encoder``, a property, was found).

    This keeps 3.10's and 3.11's rule on every Python: a component has a protocol when
    ``getattr`` finds every member :func:`protocol_members` names, and none of the protocol's
    methods is None there (None blocks a method, as in typing), which is :func:`provides`.
    Where that fails, typing's own check decides: a class that subclasses the protocol
    nominally has it (so does whatever 3.12's lookup finds: a descriptor that raises
    ``AttributeError``). On 3.11 the answer is the one ``isinstance`` always gave.

    One metaclass rather than a helper at each call site, so that every check, octfw's and
    a plugin's, stays ``isinstance(component, Protocol)`` as the plugin guide says; and rather
    than members declared so that ``getattr_static`` finds them (a property per submodule),
    which would leave a third-party model that assigns ``self.encoder = ...`` without its
    capability on 3.12, silently. ``tests/test_protocols.py`` checks every built-in
    component under 3.12's lookup, emulated on 3.11 and for real on 3.12.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        if (getattr(cls, "_is_protocol", False) and getattr(cls, "_is_runtime_protocol", False)
                and provides(instance, cls)):
            return True
        return super().__instancecheck__(instance)


@runtime_checkable
class Dataset(Protocol, metaclass=_CapabilityMeta):
    """A map-style collection of volumes.

    ``load`` decodes one volume (in a data-loader worker) and raises
    :class:`octfw.errors.CorruptFile` for a file that cannot be used; octfw
    quarantines it and substitutes the next usable sample.
    """

    def __len__(self) -> int: ...

    def load(self, index: int) -> Sample: ...

    def domain(self, index: int) -> str:
        """The domain of ``index`` without decoding pixels (for balanced sampling)."""
        ...


@runtime_checkable
class TransformCheckingDataset(Dataset, Protocol):
    """Optional: a dataset whose volumes only suit some transforms.

    The engine calls ``check_transform(transform)`` once, after both are
    built and before the first step; it raises
    :class:`octfw.errors.UserError` naming what does not match (the
    ``prepared`` dataset: volumes prepared with other transform options).
    """

    def check_transform(self, transform: Any) -> None: ...


@runtime_checkable
class RecognisingDatasetConfig(Protocol, metaclass=_CapabilityMeta):
    """Optional, on a dataset's **config class**: it recognises locations that hold its data.

    ``octfw embed`` (:func:`octfw.encoder.open_volumes`) is given a location, not a
    recipe: it builds the dataset whose config class recognises the location, with
    ``path`` set to it (``prepared``: a folder holding a ``prepared.json`` header;
    ``oct-vendor``: a file with a vendor suffix), else ``dicom``. ``recognises``
    must be cheap: a look at the name, at most one small read such as an existence
    check.
    """

    @classmethod
    def recognises(cls, fs: Any, path: str) -> bool:
        """Whether ``path`` on the fsspec filesystem ``fs`` holds this dataset's data."""
        ...


@runtime_checkable
class MaskingConfig(Protocol, metaclass=_CapabilityMeta):
    """Optional, on a transform's **config**: the patch-mask configurations it draws.

    Each is a context/target pair of batch keys (:func:`mask_keys`); the recipe hands
    the names to every factory as :attr:`BuildContext.mask_pairs`, so a masked model
    reads each pair (V-JEPA averages their losses) without knowing the transform.
    Read before anything is built: it must not import numpy or torch.
    """

    def mask_pairs(self) -> tuple[str, ...]:
        """The names of the pairs one draw makes (``("",)``: one pair)."""
        ...


@runtime_checkable
class SourcedDataset(Dataset, Protocol):
    """Optional additions to :class:`Dataset` that let octfw cache prepared volumes.

    A dataset with ``source`` (and a transform with a cache, see
    :class:`PreparingTransform`) gets a cache hit without ``load`` being
    called: the file is neither read nor decoded. The provenance of a hit is
    rebuilt from ``source(i)``, ``domain(i)``, ``label(i)`` when the dataset
    has it, and the spacing and original shape stored with the cached volume.
    Both methods must be cheap (no I/O).
    """

    def source(self, index: int) -> str:
        """The URL ``load(index)`` reports as ``provenance.source`` (file or series folder)."""
        ...

    def label(self, index: int) -> int | None:
        """The volume's class label, or None."""
        ...


@runtime_checkable
class LabelledDataset(Dataset, Protocol):
    """Optional: a dataset that knows each volume's class label without decoding it.

    An evaluator refuses a dataset without labels at build time, before
    training, when the dataset has ``label`` (else at its first evaluation).
    Must be cheap (no I/O).
    """

    def label(self, index: int) -> int | None: ...


@runtime_checkable
class PatientDataset(Dataset, Protocol):
    """Optional: a dataset that knows which patient each volume belongs to (or None).

    Evaluators keep a patient's volumes on one side of a train/test split and
    refuse a test dataset sharing a patient with the train dataset. The key is
    never shown: it may be an identifier.
    """

    def patient(self, index: int) -> str | None: ...


@runtime_checkable
class MaskedDataset(Dataset, Protocol):
    """Optional: a dataset with a binary finding mask for its volumes (dense evaluators).

    ``mask_source(index)`` names the mask file of ``index`` (None: the volume has none)
    without I/O, so an evaluator refuses a dataset without masks before decoding
    anything. ``mask(index)`` reads it: bool ``[D, H, W]`` in the axis order of
    ``load(index).volume`` (True: in the finding), or None; it raises
    :class:`octfw.errors.CorruptFile` naming the mask file when the file is missing,
    unreadable or not binary. A mask of another shape than its volume's is the
    caller's to refuse (it has the volume), naming ``mask_source(index)``.
    """

    def mask_source(self, index: int) -> str | None: ...

    def mask(self, index: int) -> "np.ndarray | None": ...


@runtime_checkable
class NamingDataset(Dataset, Protocol):
    """Optional: a dataset that names each volume's file without decoding it.

    Messages name the file; a checkpoint records a hash of all the names, so
    a resume can tell that the dataset changed.
    """

    def url(self, index: int) -> str: ...


@runtime_checkable
class DomainCountingDataset(Dataset, Protocol):
    """Optional: a dataset that counts its files per domain at once (a manifest it has read),
    instead of octfw asking ``domain(i)`` for every index."""

    def domain_counts(self) -> Mapping[str, int]: ...


@runtime_checkable
class SeriesDataset(Dataset, Protocol):
    """Optional: a dataset some of whose entries are series of single-frame files (a folder),
    not one file: ``octfw check`` and the run's first line count them apart."""

    def is_series(self, index: int) -> bool: ...


@runtime_checkable
class PreparedVolumesDataset(Dataset, Protocol):
    """Optional: a dataset of volumes already prepared by a transform (``prepared``):
    ``prepared_key`` is that transform's ``cache_key()``. Such a dataset is a cache itself,
    so octfw never puts its volumes in the transform's prepared-volume cache."""

    prepared_key: str


@runtime_checkable
class Transform(Protocol, metaclass=_CapabilityMeta):
    """Turns a :class:`Sample` into the arrays its :meth:`batch_spec` declares.

    ``rng`` is derived from (seed, epoch, index), so a sample's views and
    masks do not depend on worker count or order, and a batch can be rebuilt.
    """

    def __call__(self, sample: Sample, rng: "np.random.Generator") -> dict[str, "np.ndarray"]: ...

    def batch_spec(self) -> dict[str, BatchKey]:
        """Every key ``__call__`` returns, with its per-sample shape and dtype (fixed for the run)."""
        ...


@runtime_checkable
class PreparingTransform(Transform, Protocol):
    """Optional: a transform split into a cacheable half and a random half.

    ``transform(sample, rng)`` must equal
    ``augment_and_mask(prepare(sample), rng)``. ``prepare`` is deterministic
    (a function of the volume, its spacing and the transform's options) and
    returns float32 ``[D, H, W]``; it may raise
    :class:`octfw.errors.CorruptFile`. ``cache`` is None (no caching) or an
    object with ``get(source) -> CachedVolume | None`` and
    ``put(source, prepared, provenance)``, such as
    :class:`octfw.plugins.transforms.oct_standard.cache.PreparedCache`, keyed so that a
    changed option never reuses an entry.
    """

    cache: Any

    def prepare(self, sample: Sample) -> "np.ndarray": ...

    def augment_and_mask(self, prepared: "np.ndarray", rng: "np.random.Generator") -> dict[str, "np.ndarray"]: ...


@runtime_checkable
class MaskPreparingTransform(PreparingTransform, Protocol):
    """Optional: a preparing transform that brings a finding mask to its prepared volume's geometry.

    ``prepare_mask(mask, sample)`` takes bool ``[D, H, W]`` of ``sample.volume``'s shape
    and returns bool of the shape ``prepare(sample)`` returns, voxel for voxel over the
    same anatomy: the same resampling and fitting, nearest (thresholded) rather than
    smooth, and no intensity normalisation. Raises :class:`octfw.errors.ContractError`
    for a mask of another shape than the volume's.
    """

    def prepare_mask(self, mask: "np.ndarray", sample: Sample) -> "np.ndarray": ...


@runtime_checkable
class StorableTransform(PreparingTransform, Protocol):
    """Optional: a preparing transform whose ``prepare`` half ``octfw prepare`` can store:
    ``prepare_options()`` names, as plain data, everything that changes ``prepare``'s
    output, and ``cache_key()`` is its hash (a stored volume's ``prepared_key``)."""

    def prepare_options(self) -> dict[str, Any]: ...

    def cache_key(self) -> str: ...


@runtime_checkable
class Model(Protocol, metaclass=_CapabilityMeta):
    """What the engine trains: in practice a ``torch.nn.Module``.

    ``model(batch)`` (that is, ``forward``) takes the collated batch, a dict
    of device tensors keyed as the transform's :meth:`Transform.batch_spec`
    (plus ``domain_id``), and returns a :class:`ModelOutput`. ``inputs``
    names the keys it reads: a key the transform does not make is refused
    when the run is built. The other members are the ``nn.Module``
    methods the engine, ``octfw check`` and the evaluators call: placing the
    model on its device, the optimizer's parameters, checkpoints, and
    switching between training and evaluation.

    Hot path: ``forward`` runs every micro-step and must not force a
    device-to-host sync.
    """

    inputs: tuple[str, ...]

    def forward(self, batch: Mapping[str, "torch.Tensor"]) -> ModelOutput: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator["torch.nn.Parameter"]: ...

    def modules(self) -> Iterator[Any]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


@runtime_checkable
class EMAModel(Model, Protocol):
    """Optional: a model with an EMA target encoder (V-JEPA's ``vjepa3d``).

    ``ema_update(momentum)`` runs after every optimizer step when the
    schedule gives an EMA momentum. ``momentum`` is a device scalar; 1.0
    means "leave the EMA as it is", which is how a vetoed update leaves it
    untouched. Hot path: must not force a sync.
    """

    def ema_update(self, momentum: "torch.Tensor | float") -> None: ...


@runtime_checkable
class ParamGroupsModel(Model, Protocol):
    """Optional: the model chooses its optimizer groups.

    ``param_groups(weight_decay) -> [{"params": [...], "weight_decay": w, ...}]``
    over the trainable parameters; the engine asks at weight decay 1.0 to
    learn which groups decay (``weight_decay > 0``). Without it every
    trainable parameter is one decaying group.
    """

    def param_groups(self, weight_decay: float) -> list[dict]: ...


@runtime_checkable
class EmbeddingModel(Protocol, metaclass=_CapabilityMeta):
    """Optional: the frozen representation evaluators measure.

    ``embed(volume)`` takes float32 ``[B, C, D, H, W]`` and returns the
    target encoder's tokens ``[B, N, E]`` (or pooled ``[B, E]``). The
    evaluators call it under ``torch.no_grad``; without it they call
    ``model(volume)`` (an encoder on its own).
    """

    def embed(self, volume: "torch.Tensor") -> "torch.Tensor": ...


@runtime_checkable
class ExportableEncoder(Protocol, metaclass=_CapabilityMeta):
    """An encoder ``octfw export`` and ``run.export_encoder`` can write out.

    ``architecture()`` returns its constructor arguments as plain data (an
    export records them); ``encoder(volume)`` maps ``[B, C, D, H, W]`` to
    tokens ``[B, N, E]``; its ``state_dict`` holds the weights. The export
    formats rebuild the network as :class:`octfw.models.vit3d.ViT3DEncoder`,
    so ``octfw export`` also requires that class.
    """

    def architecture(self) -> dict: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator["torch.nn.Parameter"]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...


@runtime_checkable
class EncoderModel(Protocol, metaclass=_CapabilityMeta):
    """Optional: a model whose ``encoder`` is the network to keep after pretraining
    (the target encoder); exported when it is an :class:`ExportableEncoder`,
    and what the ``fine-tune`` evaluator trains."""

    encoder: Any


@runtime_checkable
class CountingModel(Protocol, metaclass=_CapabilityMeta):
    """Optional: ``count_parameters() -> {"encoder": n, "predictor": m, ...}``, shown by
    ``octfw check`` (else the number of trainable parameters)."""

    def count_parameters(self) -> dict[str, int]: ...


@runtime_checkable
class ActivationCheckpointing(Protocol, metaclass=_CapabilityMeta):
    """Optional, on a **submodule** of a model: its activations can be recomputed in backward.

    ``checkpoint_activations`` says whether it does; ``octfw check``'s memory
    estimate toggles it to measure the saving (the built-in ViT blocks).
    """

    checkpoint_activations: bool


@runtime_checkable
class Schedule(Protocol, metaclass=_CapabilityMeta):
    """Pure functions of the update step (0-based): no hidden state to restart.

    ``lr`` is None for a schedule that never rewrites the learning rate
    (``constant``): the optimizer keeps the ``base_lr`` it was built with.
    ``weight_decay`` and ``ema_momentum`` return None when not scheduled.
    """

    def lr(self, update_step: int) -> float | None: ...

    def weight_decay(self, update_step: int) -> float | None: ...

    def ema_momentum(self, update_step: int) -> float | None: ...


@runtime_checkable
class WarmupSchedule(Schedule, Protocol):
    """Optional: the schedule states its warmup length (update steps), so the pre-flight
    check knows where the learning rate may rise; without it the rise is inferred."""

    warmup_steps: int | None


@attrs.frozen
class GuardInputs:
    """Device tensors a guard sees once per update step, before the optimizer step."""

    update_step: int
    loss: "torch.Tensor"  #: scalar, mean over the accumulated micro-steps
    grad_norm: "torch.Tensor"  #: global L2 norm of all gradients, before clipping
    parameters: tuple  #: the trainable parameters (with their ``.grad``)
    lr: float  #: learning rate of this update (host value, known without a sync)


@runtime_checkable
class Guard(Protocol, metaclass=_CapabilityMeta):
    """Decides on the device whether an update may be applied; watches health.

    ``before_step`` runs in the hot path on every update step and must not
    force a host sync: it returns a boolean device tensor (True = apply) or
    None (no opinion), and may rescale gradients in place (``grad-clip``).
    ``at_log_step`` runs at log steps with host values and may warn, raise
    :class:`StopTraining` (something is wrong: exit 1) or raise
    :class:`TrainingDone` (a target reached: the run is done, exit 0).
    """

    def before_step(self, inputs: GuardInputs) -> "torch.Tensor | None": ...

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None: ...


@runtime_checkable
class Stateful(Protocol, metaclass=_CapabilityMeta):
    """Optional, for guards and loggers: state saved in every checkpoint and given back on resume.

    ``state_dict()`` returns plain data (it is loaded with
    ``weights_only=True``); ``load_state_dict(state)`` restores it.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class Logger(Protocol, metaclass=_CapabilityMeta):
    """Receives host scalars once per log step. Only rank 0 has loggers.

    Optional: :class:`StepListener` (``on_step``) for progress displays,
    :class:`Stateful` for state kept across a resume.
    """

    def start(self, total_update_steps: int, run_dir: Path, recipe: Mapping[str, Any]) -> None: ...

    def log(self, update_step: int, metrics: Mapping[str, float]) -> None: ...

    def finish(self, summary: Mapping[str, Any]) -> None: ...


@runtime_checkable
class StepListener(Protocol, metaclass=_CapabilityMeta):
    """Optional, for loggers: ``on_step(update_step)`` after every update step.

    It receives the host step count only (no device value, no sync), for
    progress displays. It may raise :class:`StopTraining`.
    """

    def on_step(self, update_step: int) -> None: ...


@runtime_checkable
class Checkpointer(Protocol, metaclass=_CapabilityMeta):
    """Saves and restores the whole training state.

    ``save`` is atomic: a reader never sees a partial checkpoint, and
    ``latest`` never points at one. It raises on failure; the engine warns,
    keeps training and lists the failed save in the summary.
    ``load`` must refuse a damaged checkpoint, never load it.

    Optional, and the built-ins have them all: :class:`ListingCheckpointer`,
    :class:`ClaimingCheckpointer`, :class:`CancellableCheckpointer`,
    :class:`LocatedCheckpointer`.
    """

    def save(self, update_step: int, state: Mapping[str, Any]) -> str: ...

    def latest(self) -> str | None: ...

    def load(self, location: str) -> dict[str, Any]: ...


@runtime_checkable
class ListingCheckpointer(Checkpointer, Protocol):
    """Optional: ``checkpoints() -> [(update_step, location)]``, the complete checkpoints,
    so ``octfw replay`` and ``octfw eval --checkpoints`` can choose among them (else
    only ``latest()`` is known)."""

    def checkpoints(self) -> Sequence[tuple[int, str]]: ...


@runtime_checkable
class ClaimingCheckpointer(Checkpointer, Protocol):
    """Optional: one writer per folder.

    ``claim(needed_bytes)`` holds the folder for the run (rank 0, before
    training) and raises :class:`octfw.errors.UserError` when another
    process holds it or a checkpoint could not be written (no space, no
    permission, store unreachable); ``release()`` gives it up at the end.
    """

    def claim(self, needed_bytes: int) -> None: ...

    def release(self) -> None: ...


@runtime_checkable
class CancellableCheckpointer(Checkpointer, Protocol):
    """Optional: ``cancel()`` aborts the save in flight (from another thread) when the user
    asks to stop at once (a second Ctrl-C); the unfinished write must never be loaded."""

    def cancel(self) -> None: ...


@runtime_checkable
class LocatedCheckpointer(Checkpointer, Protocol):
    """Optional: ``location``, the folder or URL checkpoints go to, named in messages about
    a failed or slow save (and probed when a store seems unreachable); None where there is none
    (a rank that does not write)."""

    location: str | None




@runtime_checkable
class Evaluator(Protocol, metaclass=_CapabilityMeta):
    """Measures the representation during or after training.

    ``every_steps``: evaluate every N update steps (None: only at the end).
    ``evaluate`` receives the training model (use its frozen target encoder,
    e.g. ``model.embed``), the device, and the update step; it returns host
    floats. The engine calls it under ``torch.no_grad`` with the RNG state
    saved and restored.
    """

    every_steps: int | None

    def evaluate(self, model: Any, device: Any, update_step: int) -> Mapping[str, float]: ...


@runtime_checkable
class RefittingEvaluator(Evaluator, Protocol):
    """Optional: an evaluator that encodes once and refits on subsets (``octfw eval --shots``).

    ``split()`` returns the (train, test) labelled volumes (each with
    ``labels``, an int array); ``fit_positions()`` the train positions a fit
    may draw from; ``encode(model, device)`` runs the frozen encoder over both
    splits once; ``score(encoded, positions)`` fits on ``positions`` and
    returns host floats. ``split_seed`` seeds the draws, so two encoders are
    fitted on the same volumes.
    """

    split_seed: int

    def split(self) -> tuple[Any, Any]: ...

    def fit_positions(self) -> Any: ...

    def encode(self, model: Any, device: Any) -> Any: ...

    def score(self, encoded: Any, positions: Any = None) -> Mapping[str, float]: ...


@runtime_checkable
class ComparingEvaluator(Evaluator, Protocol):
    """Optional: an evaluator that compares two models on the same test volumes (``octfw eval``:
    pretrained against random init).

    ``last_test_probabilities`` holds the test probabilities of its newest
    evaluation (None before one); ``difference(first, second)`` returns the
    paired metrics of two such arrays, first minus second.
    """

    last_test_probabilities: Any

    def difference(self, first: Any, second: Any) -> Mapping[str, float]: ...


#: The protocol every built component of a stage must satisfy: the build refuses one that
#: lacks a member (see :func:`missing_members`). Keyed by the stages of
#: :data:`octfw.hookspecs.STAGES` (a test keeps the two in step).
STAGE_PROTOCOLS: dict[str, type] = {
    "dataset": Dataset,
    "transform": Transform,
    "model": Model,
    "scheduler": Schedule,
    "guard": Guard,
    "logger": Logger,
    "checkpointer": Checkpointer,
    "evaluator": Evaluator,
}

#: The optional capabilities the engine, the evaluators and the commands use when a
#: stage's component has them (``isinstance(component, Protocol)``); the plugin guide
#: lists them (a test keeps it in step).
OPTIONAL_PROTOCOLS: dict[str, tuple[type, ...]] = {
    "dataset": (SourcedDataset, LabelledDataset, PatientDataset, MaskedDataset, NamingDataset,
                TransformCheckingDataset, DomainCountingDataset, SeriesDataset, PreparedVolumesDataset),
    "transform": (PreparingTransform, MaskPreparingTransform, StorableTransform),
    "model": (EMAModel, ParamGroupsModel, EmbeddingModel, EncoderModel, CountingModel),
    "scheduler": (WarmupSchedule,),
    "guard": (Stateful,),
    "logger": (StepListener, Stateful),
    "checkpointer": (ListingCheckpointer, ClaimingCheckpointer, CancellableCheckpointer, LocatedCheckpointer),
    "evaluator": (RefittingEvaluator, ComparingEvaluator),
}

_DUNDERS_DECLARED = ("__call__", "__len__")


def protocol_members(protocol: type, *, inherited: bool = True) -> tuple[str, ...]:
    """The members ``protocol`` declares, methods and attributes, in declaration order.

    ``inherited=False``: only those it adds to the protocols it extends
    (``SourcedDataset`` adds ``source`` and ``label`` to ``Dataset``)."""
    bases = [b for b in reversed(protocol.__mro__) if getattr(b, "_is_protocol", False) and b is not Protocol]
    inherited_names = {n for b in bases if b is not protocol for n in protocol_members(b)} if bases[:-1] else set()
    names: list[str] = []
    for base in bases if inherited else [protocol]:
        for name in [*base.__dict__.get("__annotations__", {}), *base.__dict__]:
            if (name.startswith("_") and name not in _DUNDERS_DECLARED) or name in names:
                continue
            if not inherited and name in inherited_names:
                continue
            names.append(name)
    return tuple(names)


@functools.lru_cache(maxsize=None)
def _declared(protocol: type) -> tuple[str, ...]:
    return protocol_members(protocol)  # once per protocol: isinstance runs on the hot path (EMAModel)


def provides(component: Any, protocol: type) -> bool:
    """Whether ``component`` has ``protocol``: ``getattr`` finds each of its members, and no
    method among them is None. ``isinstance(component, protocol)`` asks this for octfw's
    protocols on every Python (:class:`_CapabilityMeta`), the submodules, parameters and
    buffers of a ``torch.nn.Module`` included, which Python 3.12's own lookup does not see."""
    for name in _declared(protocol):
        try:
            value = getattr(component, name)
        except AttributeError:
            return False
        if value is None and callable(getattr(protocol, name, None)):
            return False
    return True


def missing_members(component: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``component`` lacks (a method that is present but
    not callable counts as missing). ``isinstance(component, protocol)`` only asks whether
    each name exists; this also tells which."""
    missing = []
    for name in protocol_members(protocol):
        # A dunder is looked up on the type, as Python does when it calls it.
        owner = type(component) if name in _DUNDERS_DECLARED else component
        if not hasattr(owner, name):
            missing.append(name)
        elif callable(getattr(protocol, name, None)) and not callable(getattr(owner, name)):
            missing.append(name)
    return missing
