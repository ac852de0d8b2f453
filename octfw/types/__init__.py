"""The contracts between stages: what each component receives and returns.

These types are light (attrs, dataclasses and typing only) so that listing and validating
recipes never imports torch. Shapes are written ``[B, C, D, H, W]``: batch,
channels, depth (B-scans), height (axial), width.

One module per stage's contract, each readable alone, and what they share; every name is
imported from here (``from octfw.types import Dataset``):

- :mod:`octfw.types.dataset`: :class:`Dataset` and its optional capabilities;
- :mod:`octfw.types.transform`: :class:`Transform` and its optional capabilities,
  :class:`MaskingConfig` (on a transform's config);
- :mod:`octfw.types.model`: :class:`ModelOutput`, :class:`Model` and its optional capabilities;
- :mod:`octfw.types.scheduler`: :class:`Schedule`, :class:`WarmupSchedule`;
- :mod:`octfw.types.guard`: :class:`GuardInputs`, :class:`Guard`;
- :mod:`octfw.types.logger`: :class:`Logger`, :class:`StepListener`;
- :mod:`octfw.types.checkpointer`: :class:`Checkpointer` and its optional capabilities;
- :mod:`octfw.types.evaluator`: :class:`Evaluator` and its optional capabilities;
- shared: :mod:`octfw.types.sample` (:class:`Sample`, :class:`Provenance`: a dataset's
  output, a transform's input), :mod:`octfw.types.batch` (the batch keys, :class:`BatchKey`,
  stored voxels), :mod:`octfw.types.component` (:class:`BuildContext`, :class:`Stateful`,
  :class:`StopTraining`, :class:`TrainingDone`), :mod:`octfw.types.capability` (how a
  component is checked against a protocol on every Python) and :mod:`octfw.types.stages`
  (:data:`STAGE_PROTOCOLS`, :data:`OPTIONAL_PROTOCOLS`).

A stage's module imports only the shared ones, never another stage's
(``tests/test_architecture.py`` checks).
"""

from __future__ import annotations

# _CapabilityMeta: the metaclass every protocol here has (tests/test_protocols.py checks it).
from octfw.types.capability import missing_members, protocol_members, provides, _CapabilityMeta
from octfw.types.batch import (
    BATCH_KEYS, BatchKey, bytes_to_intensity, dequantize, DOMAIN_ID_KEY, mask_keys,
    STORED_VIEW_DTYPES, UINT8_SCALE,
)
from octfw.types.component import BuildContext, Stateful, StopTraining, TrainingDone
from octfw.types.sample import Provenance, Sample
from octfw.types.dataset import (
    Dataset, DomainCountingDataset, LabelledDataset, LayeredDataset, MaskedDataset, NamingDataset,
    PatientDataset, PreparedVolumesDataset, RecognisingDatasetConfig, SeriesDataset,
    SourcedDataset, TransformCheckingDataset,
)
from octfw.types.transform import (
    LabelPreparingTransform, MaskingConfig, MaskPreparingTransform, PreparingTransform, StorableTransform, Transform,
)
from octfw.types.model import (
    ActivationCheckpointing, BlockwiseEncoder, CountingModel, EMAModel, EmbeddingModel, EncoderModel,
    ExportableEncoder, Model, ModelOutput, ParamGroupsModel,
)
from octfw.types.scheduler import Schedule, WarmupSchedule
from octfw.types.guard import Guard, GuardInputs
from octfw.types.logger import Logger, StepListener
from octfw.types.checkpointer import (
    CancellableCheckpointer, Checkpointer, ClaimingCheckpointer, ListingCheckpointer,
    LocatedCheckpointer, ShardedCheckpointer,
)
from octfw.types.evaluator import ComparingEvaluator, Evaluator, RefittingEvaluator
from octfw.types.stages import OPTIONAL_PROTOCOLS, STAGE_PROTOCOLS

__all__ = [
    "protocol_members", "provides", "missing_members", "BATCH_KEYS", "STORED_VIEW_DTYPES",
    "mask_keys", "BatchKey", "UINT8_SCALE", "bytes_to_intensity", "dequantize", "DOMAIN_ID_KEY",
    "BuildContext", "StopTraining", "TrainingDone", "Stateful", "Provenance", "Sample",
    "Dataset", "TransformCheckingDataset", "RecognisingDatasetConfig", "SourcedDataset",
    "LabelledDataset", "PatientDataset", "MaskedDataset", "LayeredDataset", "NamingDataset",
    "DomainCountingDataset", "SeriesDataset", "PreparedVolumesDataset", "MaskingConfig",
    "Transform", "PreparingTransform", "MaskPreparingTransform", "LabelPreparingTransform", "StorableTransform",
    "ModelOutput", "Model", "EMAModel", "ParamGroupsModel", "EmbeddingModel",
    "ExportableEncoder", "EncoderModel", "BlockwiseEncoder", "CountingModel", "ActivationCheckpointing",
    "Schedule",
    "WarmupSchedule", "GuardInputs", "Guard", "Logger", "StepListener", "Checkpointer",
    "ListingCheckpointer", "ClaimingCheckpointer", "CancellableCheckpointer",
    "LocatedCheckpointer", "ShardedCheckpointer", "Evaluator", "RefittingEvaluator", "ComparingEvaluator",
    "STAGE_PROTOCOLS", "OPTIONAL_PROTOCOLS",
]
