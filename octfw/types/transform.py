"""The transform stage's contract: a sample in, the arrays its :meth:`Transform.batch_spec`
declares out; the optional capabilities (a cacheable half, masks, a storable half) and the
mask configurations a transform's config names (:class:`MaskingConfig`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from octfw.types.batch import BatchKey
from octfw.types.capability import _CapabilityMeta
from octfw.types.sample import Sample

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = [
    "MaskingConfig", "Transform", "PreparingTransform", "MaskPreparingTransform", "LabelPreparingTransform",
    "StorableTransform",
]


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
    :class:`octfw.display.errors.CorruptFile`. ``cache`` is None (no caching) or an
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
    smooth, and no intensity normalisation. Raises :class:`octfw.display.errors.ContractError`
    for a mask of another shape than the volume's.
    """

    def prepare_mask(self, mask: "np.ndarray", sample: Sample) -> "np.ndarray": ...


@runtime_checkable
class LabelPreparingTransform(PreparingTransform, Protocol):
    """Optional: a preparing transform that brings integer labels (retinal layers) to its prepared geometry.

    ``prepare_labels(labels, sample)`` takes integer ``[D, H, W]`` of ``sample.volume``'s
    shape and returns uint8 of the shape ``prepare(sample)`` returns, voxel for voxel over
    the same anatomy: the same resampling and fitting, each output voxel the label of
    the nearest source voxel (never a value the input lacks but for the fit's padding,
    label 0). For a sample prepared earlier (``octfw prepare``), whose labels were
    prepared with it, the labels come back as they are. Raises
    :class:`octfw.display.errors.ContractError` for labels of another shape than the volume's.
    """

    def prepare_labels(self, labels: "np.ndarray", sample: Sample) -> "np.ndarray": ...


@runtime_checkable
class StorableTransform(PreparingTransform, Protocol):
    """Optional: a preparing transform whose ``prepare`` half ``octfw prepare`` can store:
    ``prepare_options()`` names, as plain data, everything that changes ``prepare``'s
    output, and ``cache_key()`` is its hash (a stored volume's ``prepared_key``)."""

    def prepare_options(self) -> dict[str, Any]: ...

    def cache_key(self) -> str: ...
