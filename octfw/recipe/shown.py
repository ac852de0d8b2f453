"""``octfw show``'s TOML: every option of the resolved recipe, those unset or derived as comments.

TOML has no null, so :func:`octfw.recipe.to_toml` (the run's ``recipe.toml``)
leaves an unset option out. Shown to a user, a missing key reads as a missing
option, so here each one is a comment in its place, saying what it becomes:

    # num_workers = 0  (derived: 0 on the cpu device, where training itself uses the cores)

The comments change nothing: the text loads back to the same recipe. Below
the header, one ``# warning:`` line per :meth:`octfw.recipe.Recipe.warnings`
(a parent's component the ``extends`` chain dropped, a safety guard missing).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import tomli_w

from octfw.recipe.config import EngineConfig, RunConfig
from octfw.recipe.fields import STAGE_METADATA
from octfw.hookspecs import STAGES
from octfw.recipe.resolved import Recipe, cache_dir_for
from octfw.registry import Registry

__all__ = ["annotated_toml"]

#: ``table.key`` -> (value or None, how it is derived) for the core options a run derives when
#: they are unset. The rules are those of the code that derives them (named in each); a value
#: that depends on the machine that trains (its cores, its accelerator) is described, not guessed.
DERIVED: dict[str, Callable[[Recipe], tuple[Any, str]]] = {
    "run.name": lambda r: (r.name, "derived: the recipe file's name"),
    "run.max_steps": lambda r: (None, f"unset: the run lasts run.epochs = {r.run.epochs} passes over the dataset"),
    "run.epochs": lambda r: (None, f"unset: the run lasts run.max_steps = {r.run.max_steps} update steps"),
    # octfw.recipe.cache_dir_for
    "run.cache_dir": lambda r: (str(cache_dir_for(r.run)), "derived: $OCTFW_CACHE_DIR, else ~/.cache/octfw"),
    # octfw.engine.distributed.layout_for
    "engine.global_batch": lambda r: (
        None, f"derived: per_device_batch {r.engine.per_device_batch} x devices x grad_accum_steps "
              f"{r.engine.grad_accum_steps}, {r.engine.per_device_batch * r.engine.grad_accum_steps} on one device"),
    # octfw.engine.data.loader_workers
    "engine.num_workers": lambda r: (
        (0, "derived: 0 on the cpu device, where training itself uses the cores") if r.run.device == "cpu" else
        (None, "derived: 0 on the cpu device; on cuda and xla the cores this process may use (its share of "
               "the host's) minus one, at most 8; octfw run logs the number")),
}

HEADER = ("# The resolved recipe: every option, defaults filled in. A commented key is unset;\n"
          "# its comment says what the run uses instead.\n")


def annotated_toml(recipe: Recipe, registry: Registry) -> str:
    """The resolved recipe as TOML with every option, unset and derived ones as comments.
    ``registry``: the components of nested component tables (an evaluator's ``dataset``)."""
    data = recipe.to_dict()
    top: list[str] = []  # empty arrays of tables: plain keys, before the first [table]
    tables: list[str] = []
    for table, cls in (("run", RunConfig), ("engine", EngineConfig)):
        tables += _table(f"[{table}]", table, data[table], cls, recipe, registry)
    for stage, (_hook, table, many) in STAGES.items():
        specs = recipe.by_stage[stage] if many else (recipe.by_stage[stage],)
        if many and not specs:
            top.append(f"{table} = []")
        for spec in specs:
            header = f"[[{table}]]" if many else f"[{table}]"
            tables += _table(header, table, spec.to_table(), spec.component.config, recipe, registry)
    # What the extends chain dropped and the safety guards missing, where a reader of the
    # resolved recipe looks first (octfw run logs the same lines at its start).
    warnings = "".join(f"# warning: {line}\n" for line in recipe.warnings())
    return HEADER + warnings + "\n".join(top + [""] + tables if top else tables)


def _table(header: str, path: str, values: Mapping[str, Any], cls: type | None, recipe: Recipe,
           registry: Registry) -> list[str]:
    """``header``, a line per key of ``values`` in order, then its sub-tables (``[transform.mask]``).
    ``cls``: the config class of the table (None for a plugin's plain ``dict`` option)."""
    fields = attrs.fields_dict(cls) if cls is not None else {}
    lines, below = [header], []
    for key, value in values.items():
        field = fields.get(key)
        if isinstance(value, dict):
            stage = field.metadata.get(STAGE_METADATA) if field is not None else None
            if stage is not None:
                nested = registry.get(stage, value["name"]).config
            else:
                nested = field.type if field is not None and attrs.has(field.type) else None
            below += _table(f"[{path}.{key}]", f"{path}.{key}", value, nested, recipe, registry)
        elif value is not None:
            lines.append(tomli_w.dumps({key: _plain(value)}).rstrip("\n"))
        else:
            derived, note = DERIVED[f"{path}.{key}"](recipe) if f"{path}.{key}" in DERIVED else (
                None, _doc(field))
            shown = f" = {tomli_w.dumps({'v': derived})[4:].strip()}" if derived is not None else ""
            lines.append(f"# {key}{shown}  ({note})")
    return lines + [""] + below


def _doc(field: attrs.Attribute | None) -> str:
    text = field.metadata.get("doc", "") if field is not None else ""
    return " ".join(text.split()) or "unset"


def _plain(value: Any) -> Any:
    """Recipe data as tomli_w writes it: None dropped inside arrays of tables, strings as str."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, str) else value
