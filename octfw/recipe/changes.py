"""What changed between the recipe a run started with and the one it is resumed with.

A resumed run must be the run that was started: the seeds' restarted cosine
came from a schedule changed under a running job. Every key of the resolved
recipe is compared; a change of a key that shapes training (the optimizer,
the schedule, the length, the data, the transform, the model, the guards'
thresholds, the seed, the precision) is refused unless the user says so
(``--allow-recipe-change``), and even then the whole schedule must pass the
pre-flight check again from the resumed step. Keys that only say where
things go, how often the run reports, or how it is watched are listed and
taken: :data:`UNTRAINED`.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

__all__ = ["RecipeChange", "recipe_changes", "UNTRAINED", "LATER"]

#: Keys (dotted, a stage array's index left out) and whole tables whose change leaves the
#: training itself as it was: where results go, how often the run reports or saves, how long
#: it waits, which device kind runs it, and every logger, checkpointer and evaluator.
UNTRAINED = (
    "run.output_dir", "run.cache_dir", "run.export_encoder", "run.device",
    "engine.log_every_steps", "engine.checkpoint_every_steps", "engine.num_workers", "engine.compile",
    "engine.peak_flops_per_device", "engine.save_deadline_s", "engine.heartbeat_s",
    "engine.collective_timeout_s", "engine.parallelism", "engine.reshard_after_forward",
    "model.activation_checkpointing",  # how memory is spent, not the numbers (engine.state's rule too)
    "model.init_channels",  # read only when init loads published weights, which a resumed run never does
    "logger", "checkpointer", "evaluator",
)

#: Keys added since runs were first recorded, each with the values that train as a run did before
#: the key existed: a recorded recipe without the key is not changed by them.
LATER = {"model.predictor_warmup_steps": (None, 0)}


class RecipeChange:
    """One changed key: ``key: old -> new``; ``trains`` when it changes the training
    (``untrained``: keys and tables taken as :data:`UNTRAINED` is)."""

    def __init__(self, key: str, old: Any, new: Any, untrained: tuple[str, ...] = UNTRAINED):
        self.key, self.old, self.new = key, old, new
        table = key.split(".", 1)[0].split("[", 1)[0]
        plain = ".".join(part.split("[", 1)[0] for part in key.split("."))
        self.trains = not (table in untrained or plain in untrained)

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"

    @property
    def values(self) -> tuple[Any, Any]:
        """(old, new), None where the key was not set."""
        return (None if self.old is _MISSING else self.old, None if self.new is _MISSING else self.new)


def _show(value: Any) -> str:
    return "(not set)" if value is _MISSING or value is None else repr(value)


_MISSING = object()


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key in sorted(value):
            yield from _flatten(value[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for index, item in enumerate(value):  # a stage array: [[guard]], [[logger]], [[evaluator]]
            yield from _flatten(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def recipe_changes(recorded: Mapping[str, Any], current: Mapping[str, Any],
                   also_untrained: tuple[str, ...] = ()) -> list[RecipeChange]:
    """Every key whose value differs between two resolved recipes, in key order. Lists and
    tuples compare by value (TOML writes tuples as arrays). ``also_untrained``: keys that leave
    this comparison's training as it was, besides :data:`UNTRAINED` (a caller that knows more
    than the two recipes: the resumed run's global batch)."""
    old, new = dict(_flatten(recorded)), dict(_flatten(current))
    changes = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if a is _MISSING and key in LATER and b in LATER[key]:
            continue  # recorded before the key existed, trained as these values train
        if _normal(a) != _normal(b):
            changes.append(RecipeChange(key, a, b, UNTRAINED + also_untrained))
    return changes


def _normal(value: Any) -> Any:
    if value is _MISSING:  # TOML has no null: a key set to None is written as no key
        return None
    return list(value) if isinstance(value, tuple) else value
