"""``collapse``: warn or stop when the representations collapse.

Partial collapse (the target encoder mapping every patch to a few
directions, or to one point, or to nothing but its position) is the
commonest V-JEPA failure: the loss keeps falling while the features become
useless. The model reports these signals, which the engine reads with the
other metrics at log steps:

- ``metric/target_std``: std across tokens of the L2-normalised target
  features, about ``1 / sqrt(embed_dim)`` when they spread over the sphere
  and 0 for a full collapse;
- ``metric/effective_rank``: the participation ratio of their spectrum, how
  many directions they use (1 for a full collapse); dominated by the largest
  directions, so it reads low (2-3) even for healthy tokens;
- ``metric/rankme``: RankMe (Garrido et al. 2023), the entropy measure papers
  report, out of ``metric/rankme_max``;
- ``metric/position_share``: the share of the token variance their position
  explains, near 1 when the tokens say where they are and nothing else.

Measured on the tiny recipe (8 x 64 x 64, LR 1e-2, docs/stability.md): with
the EMA lag, RankMe 26-33 of 64 and position share 0.67-0.87; without it the
target collapses into position within 4 updates: RankMe 3.8-5.6, position
share 0.93-0.996, while ``target_std`` stays at 0.08 (positions keep the
normalised tokens apart), so only the last three signals see it. The
defaults sit between.

This guard never touches the device: ``before_step`` has no opinion, and
``at_log_step`` compares the host values with the thresholds. A metric past
its threshold for ``patience`` log steps in a row triggers ``action``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import attrs

from octfw.recipe.fields import choices, doc, in_range, non_negative, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, GuardInputs, StopTraining

__all__ = ["CollapseConfig", "CollapseGuard", "build"]

logger = logging.getLogger(__name__)

_optional_non_negative = attrs.validators.optional(non_negative)


@attrs.frozen
class CollapseConfig:
    min_std: float | None = doc(
        "act when metric/target_std (healthy: about 1/sqrt(embed_dim)) stays below this; "
        "0: not watched",
        default=0.01, validator=_optional_non_negative,
    )
    min_effective_rank: float | None = doc(
        "act when metric/effective_rank (participation ratio, 1 = one direction; healthy tokens "
        "read 2-3, collapsed ones 1.0-1.2) stays below this; 0: not watched",
        default=1.5, validator=_optional_non_negative,
    )
    min_rankme: float | None = doc(
        "act when metric/rankme (RankMe, 1 = one direction; measured healthy 26-33 of 64 on the "
        "tiny recipe, collapsed 3.8-5.6) stays below this; 0: not watched",
        default=8.0, validator=_optional_non_negative,
    )
    max_position_share: float | None = doc(
        "act when metric/position_share (share of the token variance position explains; measured "
        "healthy 0.67-0.87, collapsed into position 0.93-0.996) stays above this; 1: not watched",
        default=0.95, validator=attrs.validators.optional(in_range(0.0, 1.0, low_open=True)),
    )
    action: str = doc(
        "'warn' prints one line per collapse episode; 'stop' ends the run cleanly",
        default="warn", validator=choices("warn", "stop"),
    )
    patience: int = doc(
        "log steps in a row a metric must stay below its threshold before acting",
        default=3, validator=positive,
    )


@attrs.frozen
class _Watch:
    """One metric the guard watches: the option that set its limit, and which side is bad."""

    option: str
    limit: float
    above: bool  #: bad when the metric is above the limit (else below)
    meaning: str  #: what a breach says, for the message


class CollapseGuard:
    def __init__(self, config: CollapseConfig):
        self.config = config
        #: metric key -> what is watched, for the metrics this guard watches.
        self.watches = {
            key: _Watch(option, limit, above, meaning)
            for key, option, limit, above, meaning in (
                ("metric/target_std", "min_std", config.min_std, False,
                 "the target_std of the target features is collapsing"),
                ("metric/effective_rank", "min_effective_rank", config.min_effective_rank, False,
                 "the effective_rank of the target features is collapsing"),
                ("metric/rankme", "min_rankme", config.min_rankme, False,
                 "the target features use few directions (RankMe)"),
                ("metric/position_share", "max_position_share", config.max_position_share, True,
                 "the target tokens carry little but their position"),
            )
            # A floor of 0 or a ceiling of 1 can never be crossed: not watched (nor reported missing).
            if limit is not None and limit != (1.0 if above else 0.0)
        }
        self._below = {key: 0 for key in self.watches}  # log steps in a row past the limit
        self._missing_reported: set[str] = set()

    def before_step(self, inputs: GuardInputs) -> None:
        return None  # host metrics at log steps only: nothing to do on the device

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None:
        for key, watch in self.watches.items():
            if key not in metrics:
                self._report_missing(key, watch)
                continue
            value = metrics[key]
            if math.isnan(value):
                continue  # a non-finite step says nothing either way; the streak stands
            breached = value > watch.limit if watch.above else value < watch.limit
            self._below[key] = self._below[key] + 1 if breached else 0
            if self._below[key] != self.config.patience:
                continue  # act once per episode, when the streak reaches patience
            message = (
                f"collapse: {key} = {value:.4g} {'>' if watch.above else '<'} {watch.option} = "
                f"{watch.limit:g} for {self.config.patience} log steps in a row, up to update step "
                f"{update_step}; {watch.meaning}"
            )
            if self.config.action == "stop":
                raise StopTraining(message)
            logger.warning(message)

    def _report_missing(self, key: str, watch: _Watch) -> None:
        if key in self._missing_reported:
            return
        self._missing_reported.add(key)
        logger.warning("collapse: the model reports no %s; guard.%s has nothing to watch", key, watch.option)

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
        "Warn or stop when the target features collapse (low std, effective rank or RankMe, or a "
        "position share near 1).",
    )
