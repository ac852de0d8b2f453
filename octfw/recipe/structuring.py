"""Structuring recipe data into typed config classes, with every problem found at once.

A problem is data: ``(path, message)``, where ``path`` names the recipe key
(``engine.base_lr``, ``guard[1].max_norm``). :class:`octfw.display.errors.RecipeError`
prints them one per line. Types are checked strictly (a string is not a
number, a boolean is not an integer); unknown keys get a did-you-mean.

Validators of a config class run exactly once each, on the converted
values, all of them collected rather than stopping at the first.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Mapping, Union, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import ClassValidationError, IterableValidationError

from octfw.display.errors import PluginError, UserError
from octfw.recipe.fields import Location, NULL_WORDS, STAGE_METADATA
from octfw.registry import Component, Registry, did_you_mean

__all__ = ["Problem", "StageSpec", "converter", "structure_config", "structure_stage", "plain",
           "describe"]

Problem = tuple[str, str]
"""``(path, message)``: one thing wrong in a recipe, at ``path``."""


@attrs.frozen
class StageSpec:
    """One stage of a recipe: the component it names and its structured config."""

    stage: str
    component: Component
    config: Any

    @property
    def name(self) -> str:
        return self.component.name

    def build(self, ctx: Any) -> Any:
        return self.component.build(self.config, ctx)

    def to_table(self) -> dict[str, Any]:
        """The component table with every option filled in, as plain data."""
        return {"name": self.name, **plain(self.config)}


def describe(value: Any) -> str:
    """How a recipe value reads in an error message."""
    if isinstance(value, str):
        return f"the string {str(value)!r}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"an array {value!r}"
    return f"{type(value).__name__} {value!r}"


def _type_word(t: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            Location: "a path or URL"}.get(t, getattr(t, "__name__", str(t)))


def _strict(kind: type, name: str):
    def structure(value: Any, _type: Any) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise ValueError(f"expected {name}, got a boolean ({str(value).lower()})")
        if kind is float and isinstance(value, int):
            return float(value)
        if not isinstance(value, kind):
            raise ValueError(f"expected {name}, got {describe(value)}")
        return str(value) if kind is str else value

    return structure


def _structure_location(value: Any, _type: Any) -> Location:
    if not isinstance(value, str):
        raise ValueError(f"expected a path or URL string, got {describe(value)}")
    if value.strip().lower() in NULL_WORDS:
        raise ValueError(
            f"{str(value)!r} is not a location; leave the key out to use the default "
            "(a null here once became a bucket named 'None')"
        )
    text = str(value)
    if "://" in text:
        bucket = text.split("://", 1)[1].split("/", 1)[0]
        if bucket.strip().lower() in NULL_WORDS:
            raise ValueError(f"{text!r} names no bucket or host ({bucket!r}); a null here once became "
                             "a bucket named 'None'")
        return Location(text)
    path = Path(text).expanduser()
    if not path.is_absolute():
        base = getattr(value, "base_dir", Path.cwd())  # recipe strings remember their file's folder
        path = (base / path).resolve()
    return Location(str(path))


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(float, _strict(float, "a number"))
    conv.register_structure_hook(bool, _strict(bool, "true or false"))
    conv.register_structure_hook(Location, _structure_location)
    conv.register_unstructure_hook(Location, str)
    conv.register_unstructure_hook(Path, str)

    def is_tuple(t: Any) -> bool:
        return get_origin(t) is tuple

    def structure_tuple(value: Any, t: Any) -> tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected an array, got {describe(value)}")
        args = get_args(t)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(conv.structure(v, args[0]) for v in value)
        if len(value) != len(args):
            raise ValueError(f"expected an array of {len(args)} values, got {len(value)}: {list(value)!r}")
        return tuple(conv.structure(v, a) for v, a in zip(value, args))

    conv.register_structure_hook_func(is_tuple, structure_tuple)

    def is_union(t: Any) -> bool:
        return get_origin(t) in (Union, types.UnionType)

    def structure_union(value: Any, t: Any) -> Any:
        members = [m for m in get_args(t) if m is not type(None)]
        if value is None and type(None) in get_args(t):
            return None
        # An exact type match wins (an int stays an int in `float | int`).
        members.sort(key=lambda m: type(value) is not m)
        errors = []
        for member in members:
            try:
                return conv.structure(value, member)
            except Exception as exc:  # noqa: BLE001 - try the next member
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else
                         f"expected {' or '.join(_type_word(m) for m in members)}, got {describe(value)}")

    conv.register_structure_hook_func(is_union, structure_union)

    def is_table(t: Any) -> bool:
        return get_origin(t) is dict or t is dict

    def structure_table(value: Any, t: Any) -> dict:
        if not isinstance(value, dict):
            raise ValueError(f"expected a table {{ ... }}, got {describe(value)}")
        return dict(value)

    conv.register_structure_hook_func(is_table, structure_table)
    conv.register_unstructure_hook_func(is_tuple, lambda t: [conv.unstructure(v) for v in t])
    return conv


_CONVERTER: cattrs.Converter | None = None


def converter() -> cattrs.Converter:
    """The one converter recipes are structured and unstructured with (made on first use)."""
    global _CONVERTER
    if _CONVERTER is None:
        _CONVERTER = _make_converter()
    return _CONVERTER


def plain(config: Any) -> dict[str, Any]:
    """A config instance as plain recipe data (every option, defaults included)."""
    return converter().unstructure(config)


def _value_problems(exc: Exception, path: str) -> list[Problem]:
    """cattrs' own walk over a nested structuring error, as (path, message) pairs."""
    if not isinstance(exc, (ClassValidationError, IterableValidationError)):
        return [(path, str(exc))]
    lines = cattrs.transform_error(exc, path=path, format_exception=lambda e, _type: str(e))
    return [tuple(reversed(line.rsplit(" @ ", 1))) for line in lines]  # "message @ path"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def structure_config(cls: type, table: Mapping[str, Any], path: str,
                     registry: Registry | None = None) -> tuple[Any, list[Problem]]:
    """Structure ``table`` into the attrs class ``cls``; return (instance or None, problems).

    Each field is typed on its own so that every problem is reported at once
    with its key. A field marked with :func:`octfw.recipe.fields.component_table`
    holds a nested component table, checked against ``registry`` and stored
    resolved (plain data, every default filled in).
    """
    conv = converter()
    attrs.resolve_types(cls)
    fields = attrs.fields_dict(cls)
    unknown: list[Problem] = [
        (_join(path, key), f"unknown key{did_you_mean(key, fields)}; valid keys: {', '.join(fields) or 'none'}")
        for key in table if key not in fields
    ]
    problems: list[Problem] = []
    nested: list[Problem] = []  # problems inside nested component tables
    values: dict[str, Any] = {}
    for name, field in fields.items():
        where = _join(path, name)
        if name not in table:
            if field.default is attrs.NOTHING:
                problems.append((where, "required key missing"))
            continue
        raw = table[name]
        stage = field.metadata.get(STAGE_METADATA)
        if stage is not None:
            if raw is not None:
                if registry is None:
                    raise TypeError(f"{where}: a {stage} component table needs the registry")
                spec, found = structure_stage(registry, stage, raw, "")
                if found:  # one problem for the table, its keys relative to it; checked
                    # like a validator, so the other fields' validators still run
                    nested.append((where, "; ".join(f"{p}: {m}" if p else m for p, m in found)))
                raw = spec.to_table() if spec is not None else raw
            values[name] = raw
        elif attrs.has(field.type):
            if not isinstance(raw, dict):
                problems.append((where, f"expected a table, got {describe(raw)}"))
                continue
            values[name], found = structure_config(field.type, raw, where, registry)
            problems += found
        else:
            try:
                values[name] = conv.structure(raw, field.type)
            except Exception as exc:  # noqa: BLE001 - every structuring error becomes a problem
                problems += _value_problems(exc, where)
    if problems:
        return None, unknown + problems
    # Every validator runs once, on the converted values, so that every failing
    # field is reported (attrs' __init__ stops at the first); validators may read
    # sibling fields, which the namespace holds with their defaults. The
    # instance is then made with validators off, and a cross-field check in
    # __attrs_post_init__ sees only values that passed.
    for name, field in fields.items():
        if field.converter is not None and name in values:
            values[name] = field.converter(values[name])
    draft = types.SimpleNamespace(**{name: values.get(name, _default(field)) for name, field in fields.items()})
    problems = nested
    for name, field in fields.items():
        if field.validator is not None and name in values:
            try:
                field.validator(draft, field, values[name])
            except (ValueError, TypeError) as exc:
                problems.append((_join(path, name), str(exc)))
    if unknown or problems:
        return None, unknown + problems
    try:
        with attrs.validators.disabled():
            return cls(**values), []
    except (ValueError, TypeError) as exc:  # a cross-field check in __attrs_post_init__
        return None, [(path, str(exc))]


def _default(field: attrs.Attribute) -> Any:
    default = field.default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]


def structure_stage(registry: Registry, stage: str, table: Any, path: str
                    ) -> tuple[StageSpec | None, list[Problem]]:
    """A component table ``{ name = "...", options }`` as a :class:`StageSpec`."""
    if not isinstance(table, Mapping):
        return None, [(path, f"expected a table with name = \"...\" naming a {stage} component, "
                             f"got {describe(table)}")]
    options = dict(table)
    name = options.pop("name", None)
    if name is None:
        choices = ", ".join(registry.names(stage)) or "none installed"
        return None, [(_join(path, "name"), f"required; choose a {stage} component: {choices}")]
    if not isinstance(name, str):
        return None, [(_join(path, "name"), f"expected a component name, got {describe(name)}")]
    try:
        component = registry.get(stage, str(name))
    except PluginError as exc:
        return None, [(_join(path, "name"), str(exc))]
    config, problems = structure_config(component.config, options, path, registry)
    if config is None:
        return None, problems
    return StageSpec(stage, component, config), problems


def structure_stage_array(registry: Registry, stage: str, raw: Any, table_name: str
                          ) -> tuple[tuple[StageSpec | None, ...], list[Problem]]:
    """``[[guard]]``-style arrays: one spec per table, no component listed twice.

    A single ``[guard]`` table where ``[[guard]]`` was meant is taken as an array of one."""
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        return (), [(table_name, f"expected an array of tables [[{table_name}]], got {describe(raw)}")]
    specs, problems = [], []
    for index, item in enumerate(raw):
        spec, found = structure_stage(registry, stage, item, f"{table_name}[{index}]")
        problems += found
        specs.append(spec)
    names = [s.name for s in specs if s is not None]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append((table_name, f"component {dup!r} is listed more than once"))
    return tuple(specs), problems


def build_component(registry: Registry, stage: str, table: Mapping[str, Any], ctx: Any, where: str) -> Any:
    """The ``stage`` component a ``{ name = ..., options }`` table names, validated and built as a
    recipe's would be (an evaluator's labelled dataset, an exported encoder's transform).
    UserError naming ``where`` and every problem of the table."""
    spec, problems = structure_stage(registry, stage, table, "")
    if spec is None or problems:
        raise UserError(f"{where}: " + "; ".join(f"{path}: {message}" if path else message
                                                 for path, message in problems))
    return spec.build(ctx)
