"""Label efficiency: a probe fitted on ``k`` labelled volumes per class, for several ``k``.

The frozen features are computed once; each shot count then fits the
classifier on ``k`` volumes of every class, drawn from the volumes the
evaluator may fit on, and measures it on the whole test split. A draw comes
from its own generator seeded with ``(seed, k, draw)``, so a shot count
gives the same volumes whatever other counts are asked for. Several draws
per count show how much the choice of the few labelled volumes matters;
``all`` is the whole train split, one draw.

The attentive probe's validation split stays whole at every shot count:
it chooses the grid member, so the labels it holds are not counted in ``k``
(the report counts them beside ``k``: :mod:`octfw.evaluation.label_efficiency`).

An evaluator whose train volumes all carry one label (``layer-segmentation``:
every volume is labelled with its layers) gets ``k`` volumes in all: the
count is of labelled volumes, not per class.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from octfw.display.errors import UserError
from octfw.display.tables import counted

__all__ = ["ALL", "parse_shots", "shot_label", "sample_per_class", "label_efficiency", "summarise"]

#: The shot count meaning "every volume of the train split".
ALL = None


def parse_shots(text: str) -> tuple[int | None, ...]:
    """``"5,10,50,all"`` -> ``(5, 10, 50, None)``, in the order given.

    Raises UserError (one line) for an empty list, a count that is not a
    positive integer, or a repeated count.
    """
    counts: list[int | None] = []
    for part in str(text).split(","):
        word = part.strip().lower()
        if word == "all":
            count: int | None = ALL
        else:
            try:
                count = int(word)
            except ValueError:
                raise UserError(f"--shots: {part.strip()!r} is not a count; give positive integers and "
                                "'all', e.g. --shots 5,10,50,all") from None
            if count < 1:
                raise UserError(f"--shots: {count} volumes per class cannot train a classifier; "
                                "give counts of 1 or more")
        if count in counts:
            raise UserError(f"--shots: {shot_label(count)} is listed twice")
        counts.append(count)
    return tuple(counts)


def shot_label(shots: int | None) -> str:
    return "all" if shots is ALL else str(shots)


def sample_per_class(labels: np.ndarray, pool: np.ndarray, shots: int, rng: np.random.Generator,
                     where: str = "") -> np.ndarray:
    """Sorted positions: ``shots`` of each class among ``labels[pool]``, drawn without replacement.

    Raises UserError when a class has fewer than ``shots`` volumes in ``pool``.
    """
    chosen = []
    for label in np.unique(labels[pool]):
        members = pool[labels[pool] == label]
        if len(members) < shots:
            if len(np.unique(labels[pool])) == 1:  # one class: the count is of labelled volumes
                raise UserError(f"{where}--shots {shots}: the train split has {counted(len(members), 'volume')} "
                                f"to fit on; use at most {len(members)}, or 'all'")
            raise UserError(f"{where}--shots {shots}: the train split has {counted(len(members), 'volume')} of label "
                            f"{label} to fit on; use at most {len(members)} per class, or 'all'")
        chosen.append(rng.choice(members, size=shots, replace=False))
    return np.sort(np.concatenate(chosen))


def label_efficiency(
    evaluator: Any,
    encoded: Any,
    shots: Sequence[int | None],
    draws: int,
    seed: int,
    on_fit: Callable[[str], None] | None = None,
    name: str | None = None,
    on_draw: Callable[[int | None, int, dict[str, float]], None] | None = None,
) -> list[tuple[int | None, list[dict[str, float]]]]:
    """``[(shots, [metrics of each draw])]`` for a :class:`octfw.types.RefittingEvaluator`
    (the built-in feature evaluators). ``on_fit(text)`` is called after each fit (progress);
    ``name`` is the evaluator's in messages (default: its class); ``on_draw(shots, draw, metrics)``
    right after each fit, while the evaluator still holds that fit's test predictions."""
    train = evaluator.split()[0]
    pool = np.asarray(evaluator.fit_positions(), dtype=np.int64)
    where = f"evaluator {name or type(evaluator).__name__}: "
    counted = "volumes" if len(np.unique(train.labels[pool])) == 1 else "per class"
    results = []
    for count in shots:
        runs = []
        for draw in range(1 if count is ALL else draws):
            positions = pool if count is ALL else sample_per_class(
                train.labels, pool, count, np.random.default_rng([seed, count, draw]), where)
            runs.append(evaluator.score(encoded, positions))
            if on_draw is not None:
                on_draw(count, draw, runs[-1])
            if on_fit is not None:
                on_fit(f"{shot_label(count)} {counted}, draw {draw + 1}")
        results.append((count, runs))
    return results


def summarise(runs: Sequence[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """``{metric: (mean, std)}`` over draws; the std is the sample standard deviation
    (0 for one draw). A metric missing from some draw is summarised over the others."""
    keys = list(dict.fromkeys(key for run in runs for key in run))
    out = {}
    for key in keys:
        values = np.asarray([run[key] for run in runs if key in run], dtype=np.float64)
        out[key] = (float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0)
    return out
