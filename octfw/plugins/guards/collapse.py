"""``collapse``: warn or stop when the representations collapse.

Partial collapse (the target encoder mapping every patch to a few
directions, or to one point) is the commonest V-JEPA failure: the loss keeps
falling while the features become useless. The model reports two signals as
device scalars every step, which the engine reads with the other metrics at
log steps:

- ``metric/target_std``: std across tokens of the L2-normalised target
  features, about ``1 / sqrt(embed_dim)`` when they spread over the sphere
  and 0 for a full collapse;
- ``metric/effective_rank``: how many directions the target features use
  (1 for a full collapse).

This guard never touches the device: ``before_step`` has no opinion, and
``at_log_step`` compares the host values with the thresholds. A metric below
its threshold for ``patience`` log steps in a row triggers ``action``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import attrs

from octfw.fields import choices, doc, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, GuardInputs, StopTraining

__all__ = ["CollapseConfig", "CollapseGuard", "build"]

logger = logging.getLogger(__name__)

_optional_positive = attrs.validators.optional(positive)


@attrs.frozen
class CollapseConfig:
    min_std: float | None = doc(
        "act when metric/target_std (healthy: about 1/sqrt(embed_dim)) stays below this; "
        "leave out to not watch it",
        default=0.01, validator=_optional_positive,
    )
    min_effective_rank: float | None = doc(
        "act when metric/effective_rank (1 = one direction) stays below this; "
        "leave out to not watch it",
        default=2.0, validator=_optional_positive,
    )
    action: str = doc(
        "'warn' prints one line per collapse episode; 'stop' ends the run cleanly",
        default="warn", validator=choices("warn", "stop"),
    )
    patience: int = doc(
        "log steps in a row a metric must stay below its threshold before acting",
        default=3, validator=positive,
    )


class CollapseGuard:
    def __init__(self, config: CollapseConfig):
        self.config = config
        #: metric key -> threshold, for the metrics this guard watches.
        self.thresholds = {
            key: limit
            for key, limit in (("metric/target_std", config.min_std),
                               ("metric/effective_rank", config.min_effective_rank))
            if limit is not None
        }
        self._below = {key: 0 for key in self.thresholds}  # log steps in a row below
        self._missing_reported: set[str] = set()

    def before_step(self, inputs: GuardInputs) -> None:
        return None  # host metrics at log steps only: nothing to do on the device

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None:
        for key, limit in self.thresholds.items():
            if key not in metrics:
                self._report_missing(key)
                continue
            value = metrics[key]
            if math.isnan(value):
                continue  # a non-finite step says nothing either way; the streak stands
            self._below[key] = self._below[key] + 1 if value < limit else 0
            if self._below[key] != self.config.patience:
                continue  # act once per episode, when the streak reaches patience
            name = key.removeprefix("metric/")
            message = (
                f"collapse: {key} = {value:.4g} < {self._option(key)} = {limit:g} for "
                f"{self.config.patience} log steps in a row, up to update step {update_step}; "
                f"the {name} of the target features is collapsing"
            )
            if self.config.action == "stop":
                raise StopTraining(message)
            logger.warning(message)

    def _option(self, key: str) -> str:
        return "min_std" if key == "metric/target_std" else "min_effective_rank"

    def _report_missing(self, key: str) -> None:
        if key in self._missing_reported:
            return
        self._missing_reported.add(key)
        logger.warning("collapse: the model reports no %s; guard.%s has nothing to watch",
                       key, self._option(key))

    def state_dict(self) -> dict[str, Any]:
        return {"below": dict(self._below)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, count in state["below"].items():
            if key in self._below:
                self._below[key] = int(count)


def build(config: CollapseConfig, ctx: BuildContext) -> CollapseGuard:
    return CollapseGuard(config)


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register(
        "collapse",
        CollapseConfig,
        build,
        "Warn or stop when the target features collapse (low std or effective rank).",
    )
