"""``nan-skip``: an update with a non-finite loss or gradient is not applied.

The verdict is a device tensor; on accelerators it goes into the update
itself (:class:`octfw.engine.optim.GatedAdamW`), so parameters, optimizer
state and EMA keep their values exactly. No host sync: the skip count is read
with the other metrics at log steps.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from octfw.recipe.fields import doc, in_range
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, GuardInputs, StopTraining


@attrs.frozen
class NanSkipConfig:
    max_consecutive_skips: int = doc(
        "Stop the run when this many updates in a row were skipped (0 = never stop).",
        default=100, validator=in_range(0, 10**9),
    )


class NanSkip:
    def __init__(self, config: NanSkipConfig):
        self.config = config
        self._skipped_at_last_log = 0.0
        self._consecutive = 0.0

    def before_step(self, inputs: GuardInputs):
        import torch

        return torch.isfinite(inputs.loss) & torch.isfinite(inputs.grad_norm)

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None:
        # Host values, read by the engine at this log step: no extra sync.
        skipped = metrics["skipped_updates"]
        interval = metrics["updates_since_log"]
        new = skipped - self._skipped_at_last_log
        self._skipped_at_last_log = skipped
        self._consecutive = self._consecutive + interval if new >= interval else 0.0
        limit = self.config.max_consecutive_skips
        if limit and self._consecutive >= limit:
            raise StopTraining(
                f"nan-skip: the last {int(self._consecutive)} updates up to step {update_step} "
                "were all skipped (non-finite loss or gradient); see guard_events.jsonl"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_at_last_log": self._skipped_at_last_log, "consecutive": self._consecutive}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._skipped_at_last_log = float(state["skipped_at_last_log"])
        self._consecutive = float(state["consecutive"])


def build(config: NanSkipConfig, ctx: BuildContext) -> NanSkip:
    return NanSkip(config)


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register(
        "nan-skip",
        NanSkipConfig,
        build,
        "Skip an update whose loss or gradient is non-finite; decided on the device.",
    )
