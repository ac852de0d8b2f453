"""Each stage's protocols: the one every built component must satisfy and the optional ones
octfw uses when a component has them. Keyed by the stages of :data:`octfw.hookspecs.STAGES`."""

from __future__ import annotations

from octfw.types.checkpointer import (
    CancellableCheckpointer, Checkpointer, ClaimingCheckpointer, ListingCheckpointer, LocatedCheckpointer,
    ShardedCheckpointer,
)
from octfw.types.component import Stateful
from octfw.types.dataset import (
    Dataset, DomainCountingDataset, LabelledDataset, LayeredDataset, MaskedDataset, NamingDataset, PatientDataset,
    PreparedVolumesDataset, SeriesDataset, SourcedDataset, TransformCheckingDataset,
)
from octfw.types.evaluator import ComparingEvaluator, Evaluator, RefittingEvaluator
from octfw.types.guard import Guard
from octfw.types.logger import Logger, StepListener
from octfw.types.model import CountingModel, EMAModel, EmbeddingModel, EncoderModel, Model, ParamGroupsModel
from octfw.types.scheduler import Schedule, WarmupSchedule
from octfw.types.transform import (
    LabelPreparingTransform, MaskPreparingTransform, PreparingTransform, StorableTransform, Transform,
)

__all__ = ["STAGE_PROTOCOLS", "OPTIONAL_PROTOCOLS"]


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
    "dataset": (SourcedDataset, LabelledDataset, PatientDataset, MaskedDataset, LayeredDataset, NamingDataset,
                TransformCheckingDataset, DomainCountingDataset, SeriesDataset, PreparedVolumesDataset),
    "transform": (PreparingTransform, MaskPreparingTransform, LabelPreparingTransform, StorableTransform),
    "model": (EMAModel, ParamGroupsModel, EmbeddingModel, EncoderModel, CountingModel),
    "scheduler": (WarmupSchedule,),
    "guard": (Stateful,),
    "logger": (StepListener, Stateful),
    "checkpointer": (ListingCheckpointer, ClaimingCheckpointer, CancellableCheckpointer, LocatedCheckpointer,
                     ShardedCheckpointer),
    "evaluator": (RefittingEvaluator, ComparingEvaluator),
}
