"""The ``oct-standard`` transform: one OCT volume -> two views and a patch mask.

Two halves, so that a cache can keep the expensive, deterministic half:

- :meth:`OCTStandardTransform.prepare`: resample to ``target_spacing``,
  normalise intensities by per-volume percentiles to [0, 1], fit to
  ``image_size``. Depends only on the volume and the options hashed by
  :meth:`~OCTStandardTransform.cache_key`.
- :meth:`OCTStandardTransform.augment_and_mask`: draws the patch mask and the
  augmentations of each view from the ``rng`` argument only, so the same seed
  gives the same arrays in any worker.

Outputs are plain numpy arrays (never MONAI MetaTensors, which carry metadata
that collate and XLA do not expect) with the dtypes of
:data:`octfw.types.BATCH_KEYS`.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path


import numpy as np
import torch
from monai.transforms import Affine, ResizeWithPadOrCrop

from octfw.display.errors import ContractError, CorruptFile
from octfw.recipe.fields import parse_bytes
from octfw.models.masks import Grid, check_context_share, mask_generator_from_config
from octfw.plugins.transforms.oct_standard.cache import PreparedCache
from octfw.plugins.transforms.oct_standard.config import OCTStandardConfig
from octfw.plugins.transforms.oct_standard.resize import nearest_indices, resize
from octfw.types import STORED_VIEW_DTYPES, BatchKey, Sample, dequantize, mask_keys

__all__ = ["OCTStandardTransform", "PREPARE_VERSION"]

#: Bumped whenever :meth:`OCTStandardTransform.prepare` changes what it
#: computes, so volumes cached by an older version are not reused.
PREPARE_VERSION = 2


def _to_numpy(image: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy of a (Meta)Tensor, with the channel axis dropped."""
    plain = image.as_tensor() if hasattr(image, "as_tensor") else image
    return plain[0].detach().to(torch.float32).numpy().copy()


class OCTStandardTransform:
    """Turns a :class:`~octfw.types.Sample` into the arrays of ``BATCH_KEYS``.

    ``patch_size`` is the model's ``[pd, ph, pw]``; ``config.image_size`` must
    be divisible by it (the factory checks). ``cache`` is the
    :class:`~octfw.plugins.transforms.oct_standard.cache.PreparedCache` the data pipeline keeps
    :meth:`prepare`'s output in, or None (set by :meth:`enable_cache`).
    """

    cache: PreparedCache | None = None

    def __init__(self, config: "OCTStandardConfig", patch_size: tuple[int, int, int]):
        self.config = config
        self.image_size = tuple(int(s) for s in config.image_size)
        self.patch_size = tuple(int(p) for p in patch_size)
        self.grid: Grid = tuple(s // p for s, p in zip(self.image_size, self.patch_size))
        self.mask_generator = mask_generator_from_config(config.mask)
        #: ``{configuration: (num_context, num_target)}``: one context/target pair of keys each
        self.mask_pairs = self.mask_generator.pairs(self.grid)
        check_context_share(self.mask_generator, self.grid)
        # Zero is the darkest normalised intensity, i.e. background.
        self._crop_pad = ResizeWithPadOrCrop(self.image_size, mode="constant") if config.fit == "crop_pad" else None

    # --- deterministic half ----------------------------------------------

    def prepare(self, sample: Sample) -> np.ndarray:
        """Resampled, normalised volume fitted to ``image_size``: float32 ``[D, H, W]``.

        Raises :class:`~octfw.display.errors.CorruptFile` for a volume that cannot be
        used (wrong rank, non-finite voxels, non-positive spacing).
        """
        source = sample.provenance.source
        if sample.prepared_key is not None:
            return self._already_prepared(sample)
        volume = np.asarray(sample.volume, dtype=np.float32)
        if volume.ndim != 3 or min(volume.shape) < 1:
            raise CorruptFile(source, f"volume must be a non-empty [D, H, W] array, "
                                      f"got shape {list(volume.shape)}")
        bad = volume.size - int(np.count_nonzero(np.isfinite(volume)))
        if bad:
            raise CorruptFile(source, f"volume has {bad} non-finite voxels")

        # A copy: the sample's array may be read-only (a memory-mapped cache).
        image = torch.tensor(volume)  # [D, H, W]
        if self.config.target_spacing is not None:
            image = self._resample(image, sample.provenance.spacing, source)
        image = self._normalise(image)
        if self._crop_pad is None:
            prepared = resize(image, self.image_size, self.config.anti_aliasing).numpy()
        else:
            prepared = _to_numpy(self._crop_pad(image[None]))
        # Interpolation can overshoot by rounding; keep the documented range.
        np.clip(prepared, 0.0, 1.0, out=prepared)
        return prepared

    def prepare_mask(self, mask: np.ndarray, sample: Sample) -> np.ndarray:
        """A finding mask (bool, ``sample.volume``'s shape) brought to :meth:`prepare`'s geometry:
        bool ``image_size``.

        The same resampling and fit as the volume, on the mask as 0/1 floats, then a
        threshold at one half: linear interpolation without anti-aliasing, so a voxel is
        in the finding when the nearest source voxels mostly are (a Gaussian first would
        erode small findings). No intensity normalisation. Raises ContractError for a
        mask of another shape, or for a volume prepared earlier (its geometry is gone).
        """
        source = sample.provenance.source
        if sample.prepared_key is not None:
            raise ContractError(f"{source}: a volume prepared earlier (octfw prepare) has no original geometry "
                                "to bring a finding mask to; give the volumes themselves")
        mask = np.asarray(mask)
        if mask.shape != np.shape(sample.volume):
            raise ContractError(f"{source}: finding mask of shape {list(mask.shape)} for a volume of shape "
                                f"{list(np.shape(sample.volume))}")
        image = torch.tensor(mask, dtype=torch.float32)
        if self.config.target_spacing is not None:
            shape = self.resampled_shape(tuple(image.shape), tuple(float(s) for s in sample.provenance.spacing))
            image = resize(image, shape, anti_aliasing=False)
        if self._crop_pad is None:
            fitted = resize(image, self.image_size, anti_aliasing=False).numpy()
        else:
            fitted = _to_numpy(self._crop_pad(image[None]))  # pads with 0: outside the finding
        return fitted >= 0.5

    def prepare_labels(self, labels: np.ndarray, sample: Sample) -> np.ndarray:
        """Integer labels (retinal layers, ``sample.volume``'s shape) brought to :meth:`prepare`'s
        geometry: uint8 ``image_size``, nearest label.

        The same two steps as the volume (resampling to ``target_spacing``, then the fit)
        with the same coordinates, each output voxel taking the label of the source voxel
        its linear interpolation weighs most (:func:`nearest_indices`): no value the input
        lacks, but for ``crop_pad``'s padding (label 0). Labels of a volume prepared
        earlier (``octfw prepare`` stored them with it) come back as they are.
        """
        source = sample.provenance.source
        labels = np.asarray(labels)
        if labels.dtype.kind not in "ui" or (labels.size and (labels.min() < 0 or labels.max() > 255)):
            raise ContractError(f"{source}: layer labels must be integers in [0, 255], got {labels.dtype}")
        if sample.prepared_key is not None:
            self._as_stored(sample)  # the options match and the volume has image_size
            if labels.shape != self.image_size:
                raise ContractError(f"{source}: prepared layer labels of shape {list(labels.shape)}, the prepared "
                                    f"volume's is {list(self.image_size)}")
            return labels.astype(np.uint8, copy=False)
        if labels.shape != np.shape(sample.volume):
            raise ContractError(f"{source}: layer labels of shape {list(labels.shape)} for a volume of shape "
                                f"{list(np.shape(sample.volume))}")
        labels = labels.astype(np.uint8, copy=False)
        if self.config.target_spacing is not None:
            shape = self.resampled_shape(tuple(labels.shape), tuple(float(s) for s in sample.provenance.spacing))
            labels = labels[np.ix_(*(nearest_indices(n, m) for n, m in zip(labels.shape, shape)))]
        if self._crop_pad is None:
            return np.ascontiguousarray(labels[np.ix_(*(nearest_indices(n, m)
                                                        for n, m in zip(labels.shape, self.image_size)))])
        fitted = _to_numpy(self._crop_pad(torch.tensor(labels, dtype=torch.float32)[None]))  # pads with 0
        return np.rint(fitted).astype(np.uint8)

    def _already_prepared(self, sample: Sample) -> np.ndarray:
        """A volume prepared earlier (``octfw prepare``), as float32."""
        return dequantize(self._as_stored(sample))

    def _as_stored(self, sample: Sample) -> np.ndarray:
        """A volume prepared earlier (``octfw prepare``), by this transform's options only, as stored."""
        if sample.prepared_key != self.cache_key():
            raise ContractError(
                f"{sample.provenance.source} was prepared by a transform with other options "
                f"(key {sample.prepared_key}, this transform's is {self.cache_key()})"
            )
        volume = np.asarray(sample.volume)
        if volume.shape != self.image_size:
            raise CorruptFile(sample.provenance.source, f"prepared volume has shape {list(volume.shape)}, "
                                                        f"transform.image_size is {list(self.image_size)}")
        return volume

    def _normalise(self, image: torch.Tensor) -> torch.Tensor:
        """Map the per-volume percentiles ``[low, high]`` to [0, 1] and clip.

        numpy's partition-based percentile, not ``torch.quantile`` (which
        sorts the whole volume and was most of the preparation time); both
        interpolate linearly. A constant volume has equal percentiles and
        becomes zeros.
        """
        low, high = np.percentile(image.numpy(), self.config.percentiles)
        if not high > low:
            return torch.zeros_like(image)
        return ((image - float(low)) / float(high - low)).clamp_(0.0, 1.0)

    def _resample(self, image: torch.Tensor, spacing: tuple[float, float, float],
                  source: str) -> torch.Tensor:
        spacing = tuple(float(s) for s in spacing)
        if len(spacing) != 3 or not all(s > 0 and math.isfinite(s) for s in spacing):
            raise CorruptFile(source, f"spacing must be 3 positive values (dz, dy, dx) mm, "
                                      f"got {list(spacing)}")
        return resize(image, self.resampled_shape(tuple(image.shape), spacing), self.config.anti_aliasing)

    def resampled_shape(self, shape: tuple[int, int, int],
                        spacing: tuple[float, float, float]) -> tuple[int, int, int]:
        """Shape after resampling from ``spacing`` to ``target_spacing`` (before fitting)."""
        target = self.config.target_spacing
        if target is None:
            return tuple(int(s) for s in shape)
        return tuple(max(1, int(round(n * s / t))) for n, s, t in zip(shape, spacing, target))

    def prepare_options(self) -> dict:
        """Everything that changes :meth:`prepare`'s output (not augmentations), as plain data."""
        c = self.config
        return {
            "version": PREPARE_VERSION,
            "image_size": list(self.image_size),
            "target_spacing": None if c.target_spacing is None else [float(s) for s in c.target_spacing],
            "anti_aliasing": bool(c.anti_aliasing),
            "percentiles": [float(p) for p in c.percentiles],
            "fit": c.fit,
        }

    def cache_key(self) -> str:
        """Hash of :meth:`prepare_options`: part of every cache entry's key, and what a prepared dataset records."""
        text = json.dumps(self.prepare_options(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def enable_cache(self, cache_dir: str | Path) -> PreparedCache:
        """Keep prepared volumes under ``<cache_dir>/prepared``, at most ``cache_max_bytes``."""
        self.cache = PreparedCache(Path(cache_dir) / "prepared", self.image_size,
                                   parse_bytes(self.config.cache_max_bytes), self.cache_key())
        return self.cache

    # --- random half -----------------------------------------------------

    @property
    def augments(self) -> bool:
        """Whether any augmentation can change a view (else both views are the volume itself)."""
        c = self.config
        return c.flip_prob > 0 or c.affine_prob > 0 or c.intensity_jitter > 0

    def augment_and_mask(self, prepared: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Both views and the patch mask for a prepared volume, drawn from ``rng``.

        A volume as ``octfw prepare`` stored it (uint8 ``b / 255``, or float16) stays so
        when nothing augments it: the views then cost a quarter or a half of float32's
        bytes to move, and the engine converts them on the device
        (:data:`octfw.types.BATCH_KEYS`)."""
        prepared = np.asarray(prepared)
        if self.augments or prepared.dtype.name not in STORED_VIEW_DTYPES:
            prepared = dequantize(prepared)
        if prepared.shape != self.image_size:
            raise ContractError(
                f"prepared volume must have shape {list(self.image_size)} "
                f"(transform.image_size), got {list(prepared.shape)}"
            )
        # The mask is drawn first so it does not change with augmentation options.
        indices = {}
        for pair, (context_idx, target_idx) in self.mask_generator(self.grid, rng).items():
            context_key, target_key = mask_keys(pair)
            indices[context_key] = context_idx.astype(np.int64, copy=False)
            indices[target_key] = target_idx.astype(np.int64, copy=False)
        if self.augments:
            context = self._augment(prepared, rng)
            target = self._augment(prepared, rng) if self.config.augment_target else prepared
        else:  # both views are the volume itself, not copies: collate copies it into the batch
            context = target = prepared
        return {
            "context": context[None],
            "target": target[None],
            **indices,
        }

    def _augment(self, volume: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One augmented view. Draws the same number of values whatever the options,
        so enabling one augmentation leaves the others' draws unchanged."""
        c = self.config
        flip = rng.random() < c.flip_prob
        affine = rng.random() < c.affine_prob
        angle = math.radians(rng.uniform(-1.0, 1.0) * c.rotate_degrees)
        scale = 1.0 + rng.uniform(-1.0, 1.0) * c.scale_range
        contrast = 1.0 + rng.uniform(-1.0, 1.0) * c.intensity_jitter
        brightness = rng.uniform(-1.0, 1.0) * c.intensity_jitter

        view = volume
        if affine:
            # Rotation about the depth axis turns each B-scan in its H x W plane.
            warp = Affine(rotate_params=(angle, 0.0, 0.0), scale_params=(1.0, scale, scale),
                          mode="bilinear", padding_mode="zeros", image_only=True)
            view = _to_numpy(warp(torch.tensor(view)[None]))
        if flip:
            view = view[:, :, ::-1]
        if c.intensity_jitter > 0:
            view = np.clip(view * contrast + brightness, 0.0, 1.0)
        return np.ascontiguousarray(view, dtype=np.float32)

    # --- contract ----------------------------------------------------------

    def __call__(self, sample: Sample, rng: np.random.Generator) -> dict[str, np.ndarray]:
        if sample.prepared_key is not None:  # as stored: no float32 copy unless a view is augmented
            return self.augment_and_mask(self._as_stored(sample), rng)
        return self.augment_and_mask(self.prepare(sample), rng)

    def batch_spec(self) -> dict[str, BatchKey]:
        """The batch this transform makes: two views ``[1, D, H, W]`` (float32, or as
        stored, uint8 or float16, when nothing augments them) and the fixed-length patch index arrays of each
        mask configuration (:func:`octfw.types.mask_keys`)."""
        view = BatchKey((1, *self.image_size), "float32", view=True)
        spec = {"context": view, "target": view}
        for pair, (num_context, num_target) in self.mask_pairs.items():
            context_key, target_key = mask_keys(pair)
            spec[context_key] = BatchKey((num_context,), "int64")
            spec[target_key] = BatchKey((num_target,), "int64")
        return spec

    def __repr__(self) -> str:
        return (f"OCTStandardTransform(image_size={list(self.image_size)}, "
                f"patch_size={list(self.patch_size)}, mask={self.mask_generator!r})")
