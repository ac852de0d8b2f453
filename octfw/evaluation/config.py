"""Options shared by the feature evaluators, and nested component tables.

An evaluator names its labelled dataset the way a recipe names any
component, as a table inside its own: ``dataset = { name = "synthetic-oct",
labels = true }``. The table is checked against the dataset component's
config class when the recipe is validated (unknown keys, bad values), and
stored resolved: relative paths made absolute against the recipe's folder,
every default filled in, only plain data (so a checkpoint that carries the
recipe still loads with ``weights_only=True``).

Light at import: attrs and octfw's light modules only.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

from octfw.fields import doc, in_range, non_negative, positive

__all__ = ["structure_table", "component_table", "FeatureEvaluatorConfig"]


def _plain_data(value: Any) -> Any:
    """Plain Python data: str subclasses (Location, recipe strings) become str,
    tuples become lists, attrs instances become dicts."""
    if attrs.has(type(value)):
        return {f.name: _plain_data(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_data(v) for v in value]
    return value


def structure_table(stage: str, table: Any, registry: Any = None) -> tuple[Any, list[str]]:
    """Structure ``{ name = ..., options }`` into a :class:`octfw.recipe.StageSpec`.

    Returns (spec or None, problems); each problem starts with the key inside
    the table (``n_volumz: unknown key ...``). ``registry`` defaults to the
    installed components.
    """
    from octfw.errors import PluginError
    from octfw.recipe import StageSpec, structure_config

    if not isinstance(table, Mapping):
        return None, [f"expected a table {{ name = \"...\", ... }} naming a {stage} component, got {table!r}"]
    if registry is None:
        from octfw.registry import load_registry

        registry = load_registry()
    options = dict(table)
    name = options.pop("name", None)
    if not isinstance(name, str):
        choices = ", ".join(registry.names(stage)) or "none installed"
        return None, [f"name: required; choose a {stage} component: {choices}"]
    try:
        component = registry.get(stage, str(name))
    except PluginError as exc:
        return None, [f"name: {exc}"]
    config, problems = structure_config(component.config, options, "")
    # structure_config writes ".key: ..." for path ""; the caller prefixes the table's key.
    problems = [p[1:] if p.startswith(".") else p.lstrip(": ") for p in problems]
    if config is None:
        return None, problems
    return StageSpec(stage, component, config), problems


def component_table(stage: str) -> tuple[Callable[[Any], Any], Callable[..., None]]:
    """(converter, validator) for a config field holding a nested ``stage`` table.

    The validator reports every problem of the table in one message. The
    converter stores the resolved table (name first, every option, plain
    data); a table it cannot resolve is kept as given for the validator to
    report.
    """

    def convert(value: Any) -> Any:
        if value is None:
            return None
        spec, problems = structure_table(stage, value)
        if spec is None or problems:
            return _plain_data(value)
        return {"name": spec.name, **_plain_data(spec.config)}

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        _spec, problems = structure_table(stage, value)
        if problems:
            raise ValueError("; ".join(problems))

    return convert, check


_convert_dataset, _check_dataset = component_table("dataset")


@attrs.frozen
class FeatureEvaluatorConfig:
    """Options every frozen-feature evaluator (``linear-probe``, ``knn``) takes."""

    dataset: dict[str, Any] = doc(
        "labelled dataset, a component table: { name = \"synthetic-oct\", labels = true, seed = 1 } "
        "or { name = \"dicom\", path = \"labels.csv\" } (a manifest with a label column)",
        converter=_convert_dataset, validator=_check_dataset,
    )
    test_dataset: dict[str, Any] | None = doc(
        "held-out labelled dataset table (e.g. the manifest with split = \"test\"); "
        "unset: `dataset` is split by train_fraction",
        default=None, converter=_convert_dataset, validator=_check_dataset,
    )
    train_fraction: float = doc(
        "share of `dataset` the classifier is fitted on when test_dataset is unset; "
        "the split is stratified by domain and label",
        default=0.5, validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    split_seed: int = doc(
        "seed of the train/test split (independent of the run's seed, so runs compare on "
        "the same split)",
        default=0, validator=non_negative,
    )
    every_steps: int | None = doc(
        "evaluate every N update steps; unset: only at the end of training",
        default=None, validator=positive,
    )
    batch_size: int = doc(
        "volumes per forward pass of the encoder during feature extraction",
        default=4, validator=positive,
    )
    keep_volumes: bool = doc(
        "keep the prepared volumes in host memory between evaluations (decoded once); "
        "false: decode and prepare them again at each evaluation",
        default=True,
    )
