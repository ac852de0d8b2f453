"""The dataset stage's contract: what every dataset has (:class:`Dataset`: each volume a
:class:`~octfw.types.sample.Sample`) and the optional capabilities octfw uses when a dataset
has them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

from octfw.types.capability import _CapabilityMeta
from octfw.types.sample import Sample

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = [
    "Dataset", "TransformCheckingDataset", "RecognisingDatasetConfig",
    "SourcedDataset", "LabelledDataset", "PatientDataset", "MaskedDataset", "LayeredDataset", "NamingDataset",
    "DomainCountingDataset", "SeriesDataset", "PreparedVolumesDataset",
]


@runtime_checkable
class Dataset(Protocol, metaclass=_CapabilityMeta):
    """A map-style collection of volumes.

    ``load`` decodes one volume (in a data-loader worker) and raises
    :class:`octfw.display.errors.CorruptFile` for a file that cannot be used; octfw
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
    :class:`octfw.display.errors.UserError` naming what does not match (the
    ``prepared`` dataset: volumes prepared with other transform options).
    """

    def check_transform(self, transform: Any) -> None: ...


@runtime_checkable
class RecognisingDatasetConfig(Protocol, metaclass=_CapabilityMeta):
    """Optional, on a dataset's **config class**: it recognises locations that hold its data.

    ``octfw embed`` (:func:`octfw.exports.volumes.open_volumes`) is given a location, not a
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
    :class:`octfw.display.errors.CorruptFile` naming the mask file when the file is missing,
    unreadable or not binary. A mask of another shape than its volume's is the
    caller's to refuse (it has the volume), naming ``mask_source(index)``.
    """

    def mask_source(self, index: int) -> str | None: ...

    def mask(self, index: int) -> "np.ndarray | None": ...


@runtime_checkable
class LayeredDataset(Dataset, Protocol):
    """Optional: a dataset with retinal layer labels for its volumes (layer segmentation).

    ``layers_source(index)`` names the label file of ``index`` and ``layer_names(index)``
    what each label value means (``names[k]`` is value ``k``, top to bottom, the
    vitreous first), both without I/O (None: the volume has none). ``layers(index)``
    reads the labels: uint8 ``[D, H, W]`` of ``load(index).volume``'s shape and axis
    order, every value below ``len(layer_names(index))``, or None; it raises
    :class:`octfw.display.errors.CorruptFile` naming the file when it is missing or unreadable.
    Bring them to the prepared volume's geometry with the transform's ``prepare_labels``
    (:class:`~octfw.types.LabelPreparingTransform`); a ``prepared`` dataset's labels are
    prepared already, and ``prepare_labels`` hands them back as they are.
    """

    def layers_source(self, index: int) -> str | None: ...

    def layer_names(self, index: int) -> "tuple[str, ...] | None": ...

    def layers(self, index: int) -> "np.ndarray | None": ...


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
