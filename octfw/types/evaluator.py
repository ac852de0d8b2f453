"""The evaluator stage's contract: measure the representation (:class:`Evaluator`), and the
optional capabilities ``octfw eval`` uses (``--shots``; pretrained against random init)."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from octfw.types.capability import _CapabilityMeta

__all__ = ["Evaluator", "RefittingEvaluator", "ComparingEvaluator"]


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

    ``last_test_probabilities`` holds what its newest evaluation kept of each test
    volume (None before one): a classifier's probabilities, a segmentation's
    per-volume Dice and boundary errors; a mapping of arrays with the test volumes
    along their first axis. ``difference(first, second)`` returns the paired
    metrics of two such mappings, first minus second, with bootstrap intervals.
    ``octfw eval --shots`` also passes several fits of each, every array stacked
    along a new first axis (fit ``f`` of both on the same train volumes): the
    difference is then the mean over the fits.
    """

    last_test_probabilities: Any

    def difference(self, first: Any, second: Any) -> Mapping[str, float]: ...
