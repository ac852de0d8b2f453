"""``loss-spike``: warn or stop when the loss jumps above k times its running median.

Looks at the loss the engine logs (host values at log steps, no extra sync).
In the seeds a loss spike preceded each NaN; a warning names the step so that
``guard_events.jsonl`` and ``octfw replay`` can find the batch.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from typing import Any, Mapping

import attrs

from octfw.recipe.fields import choices, doc, in_range, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, GuardInputs, StopTraining

logger = logging.getLogger(__name__)


@attrs.frozen
class LossSpikeConfig:
    factor: float = doc("A loss above factor x the running median is a spike.", default=3.0,
                        validator=in_range(1.0, math.inf, low_open=True))
    window: int = doc("Log steps in the running median.", default=20, validator=positive)
    min_history: int = doc("Log steps seen before spikes are judged.", default=5, validator=positive)
    action: str = doc("'warn' prints a line; 'stop' ends the run.", default="warn",
                      validator=choices("warn", "stop"))


class LossSpike:
    def __init__(self, config: LossSpikeConfig):
        self.config = config
        self.history: collections.deque = collections.deque(maxlen=config.window)

    def before_step(self, inputs: GuardInputs):
        return None

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None:
        loss = metrics.get("loss", float("nan"))
        if not math.isfinite(loss):
            return  # nan-skip's business; a non-finite value would poison the median
        if len(self.history) >= self.config.min_history:
            median = statistics.median(self.history)
            if loss > self.config.factor * median:
                message = (f"loss-spike: loss {loss:.4g} at update step {update_step} is "
                           f"{loss / median:.1f}x the running median {median:.4g}")
                if self.config.action == "stop":
                    raise StopTraining(message)
                logger.warning(message)
        self.history.append(loss)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history.extend(float(v) for v in state["history"])


def build(config: LossSpikeConfig, ctx: BuildContext) -> LossSpike:
    return LossSpike(config)


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register(
        "loss-spike",
        LossSpikeConfig,
        build,
        "Warn or stop when the logged loss exceeds factor x its running median.",
    )
