"""What every stage's component shares: the context its factory is built with
(:class:`BuildContext`), state kept across a resume (:class:`Stateful`, for guards and
loggers) and the two ways a guard or logger ends a run (:class:`StopTraining`,
:class:`TrainingDone`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import attrs

from octfw.types.capability import _CapabilityMeta

__all__ = ["BuildContext", "StopTraining", "TrainingDone", "Stateful"]


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
    #: Whether a model starts from the published weights its config's ``init`` names. False
    #: where every weight comes from elsewhere: a checkpoint restores them (a resumed run, a
    #: model rebuilt from a checkpoint), or a random initialisation is the point (the baseline
    #: ``octfw eval`` compares with).
    apply_init: bool = True

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


class StopTraining(Exception):
    """Raised by a guard or logger at a log step to end the run because something is wrong.

    The final checkpoint is written; the summary's ``stopped`` holds the
    message and ``octfw run`` exits 1 (``octfw.train`` raises
    :class:`octfw.display.errors.RunNotFinished`).
    """


class TrainingDone(StopTraining):
    """Raised by a guard or logger at a log step to end the run as finished (a target reached).

    The final checkpoint is written; the summary's ``finished_early`` holds
    the message, ``stopped`` stays empty, and the run counts as done: exit 0,
    and ``--resume auto`` does not train it again.
    """


@runtime_checkable
class Stateful(Protocol, metaclass=_CapabilityMeta):
    """Optional, for guards and loggers: state saved in every checkpoint and given back on resume.

    ``state_dict()`` returns plain data (it is loaded with
    ``weights_only=True``); ``load_state_dict(state)`` restores it.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
