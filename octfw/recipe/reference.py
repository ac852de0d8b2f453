"""The recipe reference (docs/recipe-reference.md), generated from the config
classes so that it cannot drift from the code. A test compares the committed
file with a fresh rendering."""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.config import EngineConfig, RunConfig
from octfw.hookspecs import STAGES
from octfw.registry import Registry

__all__ = ["config_rows", "render_reference"]


def _type_name(t: Any) -> str:
    if isinstance(t, type) and not getattr(t, "__args__", None):
        return t.__name__
    return str(t).replace("typing.", "").replace("octfw.recipe.fields.", "")


def config_rows(cls: type, prefix: str = "") -> list[dict[str, Any]]:
    """One row per option (nested tables flattened as ``mask.ratio``)."""
    attrs.resolve_types(cls)
    rows = []
    for field in attrs.fields(cls):
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        if attrs.has(field.type):
            rows += config_rows(field.type, f"{prefix}{field.name}.")
            continue
        rows.append({
            "key": prefix + field.name,
            "type": _type_name(field.type),
            "default": None if default is attrs.NOTHING else default,
            "required": default is attrs.NOTHING,
            "doc": field.metadata.get("doc", ""),
        })
    return rows


def _default_text(row: dict[str, Any]) -> str:
    if row["required"]:
        return "**required**"
    if row["default"] is None:
        return "unset"
    value = row["default"]
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`".replace("'", '"')


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for row in rows:
        doc = row["doc"].replace("|", "\\|").replace("\n", " ")
        kind = row["type"].replace("|", "\\|")
        out.append(f"| `{row['key']}` | `{kind}` | {_default_text(row)} | {doc} |")
    return out


def render_reference(registry: Registry) -> str:
    lines = [
        "# Recipe reference",
        "",
        "Generated from the config classes by `python -m octfw.recipe.reference > docs/recipe-reference.md`;",
        "a test fails when this file and the code disagree. `octfw list --stage S --name N` shows the",
        "same for any installed component, third-party ones included.",
        "",
        "A key left out takes its default; *unset* means the option is off or derived (see its meaning).",
        "",
    ]
    for table, cls in (("run", RunConfig), ("engine", EngineConfig)):
        lines += [f"## [{table}]", "", (cls.__doc__ or "").strip(), "", *_table(config_rows(cls)), ""]
    for stage, (_hook, table, many) in STAGES.items():
        header = f"[[{table}]]" if many else f"[{table}]"
        lines += [f"## {header}", ""]
        for component in registry.by_stage(stage):
            if component.distribution != "octfw":
                continue
            lines += [f"### `{component.name}`", "", component.summary, ""]
            rows = config_rows(component.config)
            lines += (_table(rows) if rows else ["No options."]) + [""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    from octfw.registry import load_registry

    print(render_reference(load_registry()), end="")
