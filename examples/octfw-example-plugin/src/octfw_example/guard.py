"""Registers one guard, ``loss-target``: ends the run as done once the loss reaches a target.

A guard has two methods. ``before_step`` runs on the device at every update
(return None for no opinion, or a boolean tensor: apply the update or not;
never read a device value there). ``at_log_step`` gets the logged metrics as
host floats (the keys of metrics.jsonl: ``loss``, ``loss/<domain>``, ``lr``,
``grad_norm``, ``skipped_updates``, ``metric/...``) and may raise
``TrainingDone`` (finished: exit 0) or ``StopTraining`` (a problem: exit 1).
``state_dict``/``load_state_dict`` are optional; with them the guard's state
is saved in every checkpoint and restored on resume.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from octfw.recipe.fields import doc, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, GuardInputs, TrainingDone


@attrs.frozen
class LossTargetConfig:
    below: float = doc("End the run once the logged loss stays below this.", validator=positive)
    patience: int = doc("Log steps in a row the loss must stay below the target.", default=2,
                        validator=positive)


class LossTarget:
    def __init__(self, config: LossTargetConfig):
        self.config = config
        self.streak = 0

    def before_step(self, inputs: GuardInputs) -> None:
        return None  # no opinion on single updates

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None:
        self.streak = self.streak + 1 if metrics["loss"] < self.config.below else 0
        if self.streak >= self.config.patience:
            raise TrainingDone(f"loss {metrics['loss']:.4g} below {self.config.below:g} for "
                               f"{self.streak} log steps at update step {update_step}")

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state["streak"])


def build(config: LossTargetConfig, ctx: BuildContext) -> LossTarget:
    return LossTarget(config)


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register("loss-target", LossTargetConfig, build, "End the run as done once the loss reaches a target.")
