"""Schedules: the options both built-in schedulers share, and the checks run before training.

A schedule (:class:`octfw.types.Schedule`) is a set of pure functions of the
0-based update step. Being pure, it can be evaluated at every step before a
single accelerator hour is spent:

- :func:`simulate` returns the LR, weight decay and EMA momentum of every
  update step;
- :func:`validate_schedule` lists what would go wrong: an LR that reaches 0
  before the end (the seeds' "LR = 0"), an LR that rises again after warmup
  (the seeds' hidden warm restarts), non-finite values, an EMA momentum
  outside [0, 1] or decreasing;
- :func:`plot_schedule` draws the simulated values into a PNG for the run folder.

:class:`EmaWdOptions` and :class:`EmaWdSchedule` hold the EMA momentum and
weight decay options that ``cosine-no-restart`` and ``constant`` share.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import attrs

from octfw.recipe.fields import choices, doc, in_range, non_negative

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

    from octfw.types import BuildContext, Schedule

__all__ = [
    "warmup_cosine",
    "EmaWdOptions",
    "EmaWdSchedule",
    "progress",
    "effective_lr",
    "simulate",
    "validate_schedule",
    "plot_schedule",
]

EMA_SHAPES = ("linear", "cosine", "constant")


def _ema_end_not_below_start(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    # attrs runs validators after every field is set, so ema_start is known here.
    if instance.ema_shape != "constant" and value < instance.ema_start:
        raise ValueError(
            f"must be >= ema_start ({instance.ema_start!r}), got {value!r}: "
            "an EMA momentum that falls lets the target encoder drift faster late in training"
        )


@attrs.frozen
class EmaWdOptions:
    """Config fields shared by the built-in schedulers (EMA momentum and weight decay)."""

    ema_start: float = doc(
        "EMA momentum of the target encoder at update step 0 (the seeds used 0.996)",
        default=0.996,
        validator=in_range(0.0, 1.0),
    )
    ema_end: float = doc(
        "EMA momentum at the last update step (V-JEPA: 0.998 -> 1.0, linear)",
        default=1.0,
        validator=[in_range(0.0, 1.0), _ema_end_not_below_start],
    )
    ema_shape: str = doc(
        "how the EMA momentum goes from ema_start to ema_end: 'linear', 'cosine' "
        "(BYOL/DINO: slow at both ends) or 'constant' (ema_start throughout)",
        default="linear",
        validator=choices(*EMA_SHAPES),
    )
    weight_decay_end: float | None = doc(
        "weight decay at the last update step, reached by a cosine from the optimizer's "
        "weight_decay; leave out to keep the weight decay constant",
        default=None,
        validator=non_negative,
    )
    horizon_scale: float | None = doc(
        "V-JEPA's ipe_scale. Leave out for octfw's counting (the end values at the last update "
        "step); a number >= 1 counts as V-JEPA's code does, over a horizon of horizon_scale x the "
        "run's update steps that the run stops short of (docs/reference-parity.md)",
        default=None,
        validator=in_range(1.0, math.inf),
    )


def progress(update_step: int, total_update_steps: int) -> float:
    """Fraction of the run done: 0.0 at update step 0, 1.0 at the last one and after."""
    if update_step < 0:
        raise ValueError(f"update_step must be >= 0, got {update_step}")
    last = max(1, total_update_steps - 1)
    return min(update_step, last) / last


class EmaWdSchedule:
    """EMA momentum and weight decay as functions of the update step.

    Both built-in schedulers inherit from this class, so the two options are
    written once. With ``p = progress(step, total)`` (0 at the first update,
    1 at the last, then flat):

    - linear EMA: ``ema_start + (ema_end - ema_start) * p``
    - cosine EMA: ``ema_end - (ema_end - ema_start) * (1 + cos(pi * p)) / 2``
    - constant EMA: ``ema_start``
    - weight decay: ``ctx.weight_decay`` when ``weight_decay_end`` is None, else
      ``wd_end + (wd_start - wd_end) * (1 + cos(pi * p)) / 2``.

    With ``horizon_scale`` set (V-JEPA's counting, ``H = horizon_scale * total``):
    linear EMA ``ema_start + s * (ema_end - ema_start) / H``, cosine EMA at
    ``p = s / H``, and the weight decay's cosine at ``p = (s + 1) / int(H)``:
    the operations in the order V-JEPA's code does them, so the values are
    the same floats (docs/reference-parity.md).

    The engine should write a scheduled weight decay only into the parameter
    groups that decay at all (biases and norms keep 0).
    """

    def __init__(self, options: EmaWdOptions, ctx: "BuildContext"):
        self.total_update_steps = int(ctx.total_update_steps)
        self.options = options
        self.weight_decay_start = float(ctx.weight_decay)
        #: V-JEPA's schedule length (``ipe * epochs * ipe_scale``), None for octfw's counting
        self.horizon = None if options.horizon_scale is None else options.horizon_scale * self.total_update_steps
        #: the same length as V-JEPA's cosines take it, ``int(ipe_scale * epochs * ipe)``
        self.horizon_steps = None if self.horizon is None else int(self.horizon)

    def ema_momentum(self, update_step: int) -> float:
        o = self.options
        if o.ema_shape == "constant":
            return o.ema_start
        if self.horizon is not None:
            if update_step < 0:
                raise ValueError(f"update_step must be >= 0, got {update_step}")
            step = min(update_step, self.horizon)
            if o.ema_shape == "linear":
                return o.ema_start + step * (o.ema_end - o.ema_start) / self.horizon
            p = step / self.horizon
        else:
            p = progress(update_step, self.total_update_steps)
            if o.ema_shape == "linear":
                return o.ema_start + (o.ema_end - o.ema_start) * p
        return o.ema_end - (o.ema_end - o.ema_start) * 0.5 * (1.0 + math.cos(math.pi * p))

    def weight_decay(self, update_step: int) -> float:
        end = self.options.weight_decay_end
        if self.horizon_steps is not None:
            if update_step < 0:
                raise ValueError(f"update_step must be >= 0, got {update_step}")
            p = min(1.0, (update_step + 1) / max(1, self.horizon_steps))
        else:
            p = progress(update_step, self.total_update_steps)
        if end is None:
            return self.weight_decay_start
        return end + (self.weight_decay_start - end) * 0.5 * (1.0 + math.cos(math.pi * p))


#: The share of a probe's or a fine-tune's steps spent warming up (:func:`warmup_cosine`).
PROBE_WARMUP_FRACTION = 0.1


def warmup_cosine(step: int, total: int) -> float:
    """The learning-rate factor of the evaluators' own training (the attentive probe, fine-tuning):
    linear warmup over the first 10 % of ``total`` steps, then a cosine to zero."""
    warmup = max(1, int(round(PROBE_WARMUP_FRACTION * total)))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def effective_lr(schedule: "Schedule", update_step: int, base_lr: float) -> float:
    """The LR in effect at ``update_step``: the schedule's, or ``base_lr`` when it returns None."""
    lr = schedule.lr(update_step)
    return float(base_lr) if lr is None else float(lr)


def _evaluate(schedule: "Schedule", total_update_steps: int) -> dict[str, list[float | None]]:
    """Raw values of every update step, None kept where the schedule returns None."""
    values: dict[str, list[float | None]] = {"lr": [], "weight_decay": [], "ema_momentum": []}
    for step in range(total_update_steps):
        for name, out in values.items():
            value = getattr(schedule, name)(step)
            out.append(None if value is None else float(value))
    return values


def simulate(schedule: "Schedule", total_update_steps: int, base_lr: float) -> dict[str, np.ndarray]:
    """Evaluate ``schedule`` at every update step ``0 .. total_update_steps - 1``.

    Returns float64 arrays of length ``total_update_steps``: ``update_step``,
    ``lr`` (the LR in effect, see :func:`effective_lr`), ``weight_decay`` and
    ``ema_momentum`` (NaN where the schedule returns None: not scheduled).
    """
    import numpy as np  # not at import: validating a recipe (the schedulers' configs) stays numpy-free

    raw = _evaluate(schedule, total_update_steps)
    lr = [float(base_lr) if v is None else v for v in raw["lr"]]
    out = {"update_step": np.arange(total_update_steps, dtype=np.float64)}
    out["lr"] = np.asarray(lr, dtype=np.float64)
    for name in ("weight_decay", "ema_momentum"):
        out[name] = np.asarray([math.nan if v is None else v for v in raw[name]], dtype=np.float64)
    return out


def _pair(before: float, after: float) -> str:
    """``before -> after`` with enough digits that the two differ on screen."""
    a, b = f"{before:.1e}", f"{after:.1e}"
    if a == b:
        a, b = repr(before), repr(after)
    return f"{a} -> {b}"


def _warmup_end(lr: list[float], warmup_steps_hint: int | None) -> int:
    """First update step at which the LR may no longer rise.

    With a hint, the warmup is the first ``warmup_steps_hint`` steps. Without
    one, it is the initial run of non-decreasing LRs (a warmup, or a flat LR).
    """
    if warmup_steps_hint is not None:
        return max(1, int(warmup_steps_hint))
    step = 1
    while step < len(lr) and lr[step] >= lr[step - 1]:
        step += 1
    return step


def validate_schedule(
    schedule: "Schedule",
    total_update_steps: int,
    base_lr: float,
    warmup_steps_hint: int | None = None,
) -> list[str]:
    """Every problem of ``schedule`` over the run, one line each naming the update step.

    Refused: an LR <= 0 before the last update step (or < 0 at it), an LR that
    rises after the warmup (``warmup_steps_hint`` steps, else the initial
    non-decreasing run), any non-finite value, a negative weight decay, an EMA
    momentum outside [0, 1] or decreasing. Only the first step of each kind of
    problem is reported. An empty list means the schedule may be used.
    """
    total = int(total_update_steps)
    if total <= 0:
        return [f"the run has {total} update steps; there is nothing to schedule"]
    try:
        raw = _evaluate(schedule, total)
    except Exception as exc:  # noqa: BLE001 - reported as a problem with its type
        return [f"the schedule fails before training: {type(exc).__name__}: {exc}"]

    problems: list[str] = []
    lr = [float(base_lr) if v is None else v for v in raw["lr"]]

    for name, seq in (("lr", lr), ("weight_decay", raw["weight_decay"]), ("ema_momentum", raw["ema_momentum"])):
        for step, value in enumerate(seq):
            if value is not None and not math.isfinite(value):
                problems.append(f"{name} is {value} at update step {step} of {total}")
                break

    for step, value in enumerate(lr):
        if math.isfinite(value) and (value < 0 or (value == 0 and step < total - 1)):
            problems.append(f"lr reaches {value} at update step {step} of {total}")
            break

    # A relative tolerance so that float rounding in a flat tail is not a "rise".
    for step in range(_warmup_end(lr, warmup_steps_hint), total):
        before, after = lr[step - 1], lr[step]
        if after > before + 1e-9 * abs(before):
            problems.append(
                f"lr rises after warmup at update step {step}: {_pair(before, after)}; "
                "a schedule with restarts is refused"
            )
            break

    for step, value in enumerate(raw["weight_decay"]):
        if value is not None and value < 0:
            problems.append(f"weight_decay is {value} at update step {step} of {total}; it must be >= 0")
            break

    ema = raw["ema_momentum"]
    for step, value in enumerate(ema):
        if value is not None and not 0.0 <= value <= 1.0:
            problems.append(f"ema_momentum is {value} at update step {step} of {total}, outside [0, 1]")
            break
    for step in range(1, total):
        before, after = ema[step - 1], ema[step]
        if before is not None and after is not None and after < before - 1e-12:
            problems.append(f"ema_momentum decreases at update step {step}: {before!r} -> {after!r}")
            break
    return problems


def plot_schedule(values: Mapping[str, np.ndarray], png_path: str | Path) -> Path:
    """Draw LR, weight decay and EMA momentum over update steps into ``png_path``.

    ``values`` is what :func:`simulate` returns. Three stacked panels share
    the update-step axis; a quantity that is not scheduled (all NaN) says so.
    Uses matplotlib's Agg canvas without pyplot, so no display and no global
    backend switch is involved.
    """
    import numpy as np
    from matplotlib.figure import Figure  # heavy import: only when a plot is drawn

    lr = np.asarray(values["lr"], dtype=np.float64)
    steps = np.asarray(values.get("update_step", np.arange(len(lr))), dtype=np.float64)
    panels = (("lr", "learning rate"), ("weight_decay", "weight decay"), ("ema_momentum", "EMA momentum"))

    fig = Figure(figsize=(7.0, 7.5), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    for ax, (key, label) in zip(axes, panels):
        series = np.asarray(values[key], dtype=np.float64)
        if np.isnan(series).all():
            ax.text(0.5, 0.5, "not scheduled", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.plot(steps, series, linewidth=1.5)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_title(f"schedule over {len(lr)} update steps")
    axes[-1].set_xlabel("update step")

    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
