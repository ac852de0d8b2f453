"""Recipes: TOML files that compose components into one training run.

Loading a recipe is four steps, all before any data or device is touched:

1. read the TOML file and the chain of files it ``extends``;
2. apply ``--set table.key=value`` overrides;
3. structure ``[run]`` and ``[engine]`` and each stage table into the config
   class of the component it names, refusing unknown keys;
4. report every problem at once, each naming ``table.key``, what was expected
   and, for a misspelled key or component, the closest valid name.

Relative paths resolve against the folder of the file that wrote them (the
current directory for ``--set`` values).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path
import types
from typing import Any, Iterator, Mapping, Sequence, Union, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import ClassValidationError, IterableValidationError

from octfw.config import EngineConfig, RunConfig
from octfw.errors import PluginError, RecipeError, UserError
from octfw.fields import Location
from octfw.hookspecs import STAGES
from octfw.registry import Component, Registry, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Recipe", "StageSpec", "load_recipe", "parse_override", "DEFAULT_STAGES"]

#: Components used when a recipe leaves a stage out. dataset, transform and
#: model have no default: a recipe must say what it trains on and what.
DEFAULT_STAGES: dict[str, Any] = {
    "scheduler": {"name": "cosine-no-restart"},
    "guard": [{"name": "nan-skip"}],
    "logger": [{"name": "console"}, {"name": "jsonl"}],
    "checkpointer": {"name": "local"},
    "evaluator": [],
}
CORE_TABLES = {"run": RunConfig, "engine": EngineConfig}
TOP_LEVEL_KEYS = ["extends", *CORE_TABLES, *STAGES]
NULL_WORDS = {"none", "null", "nil", ""}


class _Sourced(str):
    """A string from a recipe file or ``--set``, remembering the folder that
    relative paths in it are relative to."""

    base_dir: Path

    def __new__(cls, value: str, base_dir: Path) -> "_Sourced":
        obj = super().__new__(cls, value)
        obj.base_dir = base_dir
        return obj


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


@attrs.frozen
class Recipe:
    """A validated recipe. Every value is typed; nothing is read with a default later."""

    source: Path
    run: RunConfig
    engine: EngineConfig
    dataset: StageSpec
    transform: StageSpec
    model: StageSpec
    scheduler: StageSpec
    guards: tuple[StageSpec, ...]
    loggers: tuple[StageSpec, ...]
    checkpointer: StageSpec
    evaluators: tuple[StageSpec, ...] = ()

    @property
    def name(self) -> str:
        return self.run.name or self.source.stem

    @property
    def folder(self) -> Path:
        return self.source.parent

    def stages(self) -> Iterator[StageSpec]:
        yield from (self.dataset, self.transform, self.model, self.scheduler)
        yield from self.guards
        yield from self.loggers
        yield self.checkpointer
        yield from self.evaluators

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe with every default filled in (None values left out)."""
        out: dict[str, Any] = {
            "run": _plain(self.run),
            "engine": _plain(self.engine),
        }
        for stage in ("dataset", "transform", "model", "scheduler"):
            spec = getattr(self, stage)
            out[stage] = {"name": spec.name, **_plain(spec.config)}
        out["guard"] = [{"name": s.name, **_plain(s.config)} for s in self.guards]
        out["logger"] = [{"name": s.name, **_plain(s.config)} for s in self.loggers]
        out["checkpointer"] = {"name": self.checkpointer.name, **_plain(self.checkpointer.config)}
        out["evaluator"] = [{"name": s.name, **_plain(s.config)} for s in self.evaluators]
        return out


def _plain(config: Any) -> dict[str, Any]:
    return _converter().unstructure(config)


# --------------------------------------------------------------------------
# reading files


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: recipe not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read recipe: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    return _mark_strings(data, path.parent.resolve())


def _mark_strings(value: Any, base_dir: Path) -> Any:
    if isinstance(value, str):
        return _Sourced(value, base_dir)
    if isinstance(value, list):
        return [_mark_strings(v, base_dir) for v in value]
    if isinstance(value, dict):
        return {k: _mark_strings(v, base_dir) for k, v in value.items()}
    return value


def read_with_extends(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise UserError(f"{path}: recipes extend each other in a cycle: {chain}")
    data = _read_toml(path)
    parent_ref = data.pop("extends", None)
    if parent_ref is None:
        return data
    if not isinstance(parent_ref, str):
        raise UserError(f"{path}: extends: expected a file name, got {parent_ref!r}")
    parent_path = path.parent / parent_ref
    if not parent_path.exists():
        raise UserError(f"{path}: extends: {parent_ref!r} not found (looked for {parent_path})")
    return merge(read_with_extends(parent_path, (*seen, path)), data)


def merge(base: Mapping[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """Child values win; tables merge key by key; arrays (of tables) replace.

    A stage table whose ``name`` changes drops the parent's options, which
    belonged to the other component.
    """
    out = dict(base)
    for key, value in child.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            if "name" in value and "name" in old and value["name"] != old["name"]:
                out[key] = dict(value)
            else:
                out[key] = merge(old, value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------
# overrides


def parse_override(text: str, cwd: Path | None = None) -> tuple[list[str], Any]:
    """``"engine.base_lr=1e-4"`` -> (["engine", "base_lr"], 1e-4).

    The value is read as a TOML value (numbers, booleans, arrays, quoted
    strings); anything else is taken as a bare string.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"--set {text!r}: expected table.key=value, e.g. engine.base_lr=1e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), _mark_strings(value, (cwd or Path.cwd()).resolve())


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(path[:-1]):
            where = ".".join(path[: i + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise UserError(f"--set {text}: {where}: no entry {part} (the array has {len(node)})")
                node = node[int(part)]
            else:
                if not isinstance(node.get(part, {}), (dict, list)):
                    raise UserError(f"--set {text}: {where} is a value, not a table")
                node = node.setdefault(part, {})
        last = path[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise UserError(f"--set {text}: no entry {last} (the array has {len(node)})")
            node[int(last)] = value
        else:
            if last == "name" and node.get("name") not in (None, value):
                node.clear()  # the old component's options do not fit the new one
            node[last] = value
    return data


# --------------------------------------------------------------------------
# structuring


def _strict(kind: type, name: str):
    def structure(value: Any, _type: Any) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise ValueError(f"expected {name}, got a boolean ({str(value).lower()})")
        if kind is float and isinstance(value, int):
            return float(value)
        if not isinstance(value, kind):
            raise ValueError(f"expected {name}, got {_describe(value)}")
        return str(value) if kind is str else value

    return structure


def _structure_location(value: Any, _type: Any) -> Location:
    if not isinstance(value, str):
        raise ValueError(f"expected a path or URL string, got {_describe(value)}")
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
        base = getattr(value, "base_dir", Path.cwd())
        path = (base / path).resolve()
    return Location(str(path))


def _type_word(t: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            Location: "a path or URL"}.get(t, getattr(t, "__name__", str(t)))


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {str(value)!r}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"an array {value!r}"
    return f"{type(value).__name__} {value!r}"


_CONVERTER: cattrs.Converter | None = None


def _converter() -> cattrs.Converter:
    global _CONVERTER
    if _CONVERTER is not None:
        return _CONVERTER
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
            raise ValueError(f"expected an array, got {_describe(value)}")
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
                         f"expected {' or '.join(_type_word(m) for m in members)}, got {_describe(value)}")

    conv.register_structure_hook_func(is_union, structure_union)

    def is_table(t: Any) -> bool:
        return get_origin(t) is dict or t is dict

    def structure_table(value: Any, t: Any) -> dict:
        if not isinstance(value, dict):
            raise ValueError(f"expected a table {{ ... }}, got {_describe(value)}")
        return dict(value)

    conv.register_structure_hook_func(is_table, structure_table)
    conv.register_unstructure_hook_func(is_tuple, lambda t: [conv.unstructure(v) for v in t])
    _CONVERTER = conv
    return conv


def _leaf_problems(exc: BaseException, path: str) -> list[str]:
    """Messages from cattrs for one value (a tuple or union may nest them)."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without_notes = exc.group_exceptions()
        problems = []
        for sub, note in with_notes:
            where = f"[{note.index}]" if hasattr(note, "index") else f".{note.name}"
            problems += _leaf_problems(sub, path + where)
        for sub in without_notes:
            problems += _leaf_problems(sub, path)
        return problems
    return [f"{path}: {exc}"]


def structure_config(cls: type, table: Mapping[str, Any], path: str) -> tuple[Any, list[str]]:
    """Structure ``table`` into the attrs class ``cls``; return (instance or None, problems).

    Each field is typed and validated on its own so that every problem is
    reported at once with its key; the instance is built (running any
    cross-field check in ``__attrs_post_init__``) only when the fields are fine.
    """
    conv = _converter()
    attrs.resolve_types(cls)
    fields = {f.name: f for f in attrs.fields(cls)}
    unknown = []
    for key in table:
        if key not in fields:
            hint = did_you_mean(key, fields)
            unknown.append(f"{path}.{key}: unknown key{hint}; valid keys: {', '.join(fields) or 'none'}")
    problems: list[str] = []
    values: dict[str, Any] = {}
    for name, field in fields.items():
        where = f"{path}.{name}"
        if name not in table:
            if field.default is attrs.NOTHING:
                problems.append(f"{where}: required key missing")
            continue
        raw = table[name]
        if attrs.has(field.type):
            if not isinstance(raw, dict):
                problems.append(f"{where}: expected a table, got {_describe(raw)}")
                continue
            value, found = structure_config(field.type, raw, where)
            problems += found
        else:
            try:
                value = conv.structure(raw, field.type)
            except Exception as exc:  # noqa: BLE001 - every structuring error becomes a message
                problems += _leaf_problems(exc, where)
                continue
        values[name] = value
    if problems:
        return None, unknown + problems
    # Validators may look at other fields: give them an instance that holds
    # every value (defaults included) without running __init__ yet.
    draft = object.__new__(cls)
    for name, field in fields.items():
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        object.__setattr__(draft, name, values.get(name, default))
    for name, field in fields.items():
        if field.validator is not None and name in values:
            try:
                field.validator(draft, field, values[name])
            except (ValueError, TypeError) as exc:
                problems.append(f"{path}.{name}: {exc}")
    if unknown or problems:
        return None, unknown + problems
    try:
        return cls(**values), []
    except (ValueError, TypeError) as exc:  # cross-field checks in __attrs_post_init__
        return None, [f"{path}: {exc}"]


def _structure_stage(
    registry: Registry, stage: str, table: Any, path: str
) -> tuple[StageSpec | None, list[str]]:
    if not isinstance(table, dict):
        return None, [f"{path}: expected a table with name = \"...\", got {_describe(table)}"]
    options = dict(table)
    name = options.pop("name", None)
    if name is None:
        choices = ", ".join(registry.names(stage))
        return None, [f"{path}.name: required; choose a {stage} component: {choices}"]
    if not isinstance(name, str):
        return None, [f"{path}.name: expected a component name, got {_describe(name)}"]
    try:
        component = registry.get(stage, str(name))
    except PluginError as exc:
        return None, [f"{path}.name: {exc}"]
    config, problems = structure_config(component.config, options, path)
    if config is None:
        return None, problems
    return StageSpec(stage, component, config), problems


def validate(data: Mapping[str, Any], registry: Registry, source: Path) -> Recipe:
    """Turn merged recipe data into a :class:`Recipe`, or raise :class:`RecipeError`."""
    problems: list[str] = []
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            hint = did_you_mean(key, TOP_LEVEL_KEYS)
            problems.append(f"{key}: unknown table{hint}; valid tables: {', '.join(TOP_LEVEL_KEYS[1:])}")

    core: dict[str, Any] = {}
    for key, cls in CORE_TABLES.items():
        table = data.get(key, {})
        if not isinstance(table, dict):
            problems.append(f"{key}: expected a table, got {_describe(table)}")
            continue
        core[key], found = structure_config(cls, table, key)
        problems += found

    stages: dict[str, Any] = {}
    for stage, (_hook, table_name, many) in STAGES.items():
        if table_name in data:
            raw = data[table_name]
        elif stage in DEFAULT_STAGES:
            raw = DEFAULT_STAGES[stage]
        else:
            choices = ", ".join(registry.names(stage)) or "none installed"
            problems.append(f"[{table_name}]: missing; choose a {stage} component: {choices}")
            continue
        if many:
            if isinstance(raw, dict):
                raw = [raw]  # a single [guard] table where [[guard]] was meant
            if not isinstance(raw, list):
                problems.append(f"{table_name}: expected an array of tables [[{table_name}]], got {_describe(raw)}")
                continue
            specs = []
            for i, item in enumerate(raw):
                spec, found = _structure_stage(registry, stage, item, f"{table_name}[{i}]")
                problems += found
                specs.append(spec)
            names = [s.name for s in specs if s is not None]
            for dup in sorted({n for n in names if names.count(n) > 1}):
                problems.append(f"{table_name}: component {dup!r} is listed more than once")
            stages[stage] = tuple(specs)
        else:
            stages[stage], found = _structure_stage(registry, stage, raw, table_name)
            problems += found

    if problems:
        raise RecipeError(str(source), problems)
    return Recipe(
        source=source,
        run=core["run"],
        engine=core["engine"],
        dataset=stages["dataset"],
        transform=stages["transform"],
        model=stages["model"],
        scheduler=stages["scheduler"],
        guards=stages["guard"],
        loggers=stages["logger"],
        checkpointer=stages["checkpointer"],
        evaluators=stages["evaluator"],
    )


def load_recipe(
    path: str | Path, overrides: Sequence[str] = (), registry: Registry | None = None
) -> Recipe:
    """Read, merge, override and validate a recipe. Imports no heavy dependency."""
    source = Path(path)
    if source.is_dir():
        raise UserError(f"{source}: is a folder; give a recipe file (.toml)")
    data = read_with_extends(source)
    for stage, default in DEFAULT_STAGES.items():
        data.setdefault(stage, copy.deepcopy(default))
    data = apply_overrides(data, overrides)
    if registry is None:
        from octfw.registry import load_registry

        registry = load_registry()
    return validate(data, registry, source.resolve())


# --------------------------------------------------------------------------
# writing TOML (for `octfw show` and the run directory)


def to_toml(data: Mapping[str, Any]) -> str:
    """Write resolved recipe data as TOML. Unset values appear as comments."""
    lines: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v) if isinstance(v, float) else str(v)
        if isinstance(v, str):
            return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    def table(header: str, body: Mapping[str, Any]) -> None:
        lines.append(header)
        nested = []
        for k, v in body.items():
            if isinstance(v, dict):
                nested.append((k, v))
            elif v is None:
                lines.append(f"# {k} = (unset)")
            else:
                lines.append(f"{k} = {value(v)}")
        lines.append("")
        name = header.strip("[]")
        for k, v in nested:
            table(f"[{name}.{k}]", v)

    for key, body in data.items():
        if isinstance(body, list):
            for item in body:
                table(f"[[{key}]]", item)
        else:
            table(f"[{key}]", body)
    return "\n".join(lines).rstrip() + "\n"
