"""Reading recipe files: TOML, the ``extends`` chain and ``--set`` overrides.

The result is plain recipe data (dicts, lists, values); nothing is typed or
validated here. Every string remembers the folder of the file (or the
current directory, for ``--set``) that wrote it, so relative paths resolve
against it later.

**Arrays of tables and** ``extends``. A child's ``[[guard]]``, ``[[logger]]``
or ``[[evaluator]]`` replaces the parent's whole array, unless the child says
``append = ["guard"]``. Replacing is what Hydra (OmegaConf) and Lightning's CLI
do with a list a later config sets, and it keeps every existing recipe meaning
what it meant: a child that lists its guards gets exactly those. What a
replacement drops is never silent: :func:`read_with_extends` records each
parent component the child's array leaves out (:class:`Dropped`), and
``octfw show``, ``octfw check`` and the start of ``octfw run`` name them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from octfw.display.errors import UserError

__all__ = ["SourcedStr", "Dropped", "read_with_extends", "merge", "parse_override", "apply_overrides"]


class SourcedStr(str):
    """A string from a recipe file or ``--set``, remembering the folder that
    relative paths in it are relative to."""

    base_dir: Path

    def __new__(cls, value: str, base_dir: Path) -> "SourcedStr":
        obj = super().__new__(cls, value)
        obj.base_dir = base_dir
        return obj


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: recipe not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read recipe: {exc.strerror}") from None
    try:
        # utf-8-sig: editors on Windows start a UTF-8 file with a byte order mark,
        # which TOML does not allow; dropping it is what other TOML readers do.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        # Most often a checkpoint or an image given where the recipe goes.
        raise UserError(f"{path}: not a recipe: byte {exc.object[exc.start]:#04x} at offset {exc.start} "
                        "is not UTF-8 text (a recipe is a UTF-8 TOML file)") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    return _mark_strings(data, path.parent.resolve())


def _mark_strings(value: Any, base_dir: Path) -> Any:
    if isinstance(value, str):
        return SourcedStr(value, base_dir)
    if isinstance(value, list):
        return [_mark_strings(v, base_dir) for v in value]
    if isinstance(value, dict):
        return {k: _mark_strings(v, base_dir) for k, v in value.items()}
    return value


class Dropped(NamedTuple):
    """Components of a parent recipe's array of tables that a child's own array replaced."""

    file: Path  #: the child recipe whose ``[[table]]`` replaced the parent's
    table: str  #: ``guard``, ``logger``, ``evaluator``
    parent: str  #: the parent, as the child's ``extends`` names it
    names: tuple[str, ...]  #: the parent's components the child's array does not list

    def describe(self) -> str:
        return (f"{self.file}: its [[{self.table}]] replaces those of {self.parent}, dropping "
                f"{', '.join(self.names)}; to keep them, add append = [\"{self.table}\"] before its first "
                f"table (or list them again)")


def read_with_extends(path: Path, seen: tuple[Path, ...] = (),
                      dropped: list[Dropped] | None = None) -> dict[str, Any]:
    """The recipe at ``path`` merged over the chain of files it ``extends``.

    ``dropped``: where a child's array of tables replaces its parent's, a
    :class:`Dropped` naming the parent's components it leaves out is added to
    this list (for every file of the chain)."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise UserError(f"{path}: recipes extend each other in a cycle: {chain}")
    data = _read_toml(path)
    parent_ref = data.pop("extends", None)
    append = data.pop("append", [])
    if parent_ref is None:
        if append:
            raise UserError(f"{path}: append: only a recipe that extends another can append to its arrays")
        return data
    if not isinstance(parent_ref, str):
        raise UserError(f"{path}: extends: expected a file name, got {parent_ref!r}")
    parent_path = path.parent / parent_ref
    if not parent_path.exists():
        raise UserError(f"{path}: extends: {parent_ref!r} not found (looked for {parent_path})")
    parent = read_with_extends(parent_path, (*seen, path), dropped)
    if not isinstance(append, list) or not all(isinstance(key, str) for key in append):
        raise UserError(f"{path}: append: expected a list of array names, e.g. append = [\"guard\"]")
    for key in append:
        if not isinstance(data.get(key), list):
            raise UserError(f"{path}: append = [{key!r}]: this file has no [[{key}]] tables to append")
        if not isinstance(parent.get(key, []), list):
            raise UserError(f"{path}: append = [{key!r}]: {parent_ref} has no array {key!r} to append to")
    if dropped is not None:
        dropped += _replaced(parent, data, append, path, parent_ref)
    return merge(parent, data, append=tuple(append))


def _name(table: Any) -> Any:
    return table.get("name") if isinstance(table, dict) else None


def _replaced(parent: Mapping[str, Any], child: Mapping[str, Any], append: Sequence[str], path: Path,
              parent_ref: str) -> list[Dropped]:
    """What each of the child's arrays of tables that replaces the parent's leaves out."""
    out = []
    for key, value in child.items():
        old = parent.get(key)
        if key in append or not isinstance(value, list) or not isinstance(old, list):
            continue
        kept = [_name(table) for table in value]
        names = tuple(str(_name(table)) for table in old if _name(table) is not None and _name(table) not in kept)
        if names:
            out.append(Dropped(path, key, parent_ref, names))
    return out


def merge(base: Mapping[str, Any], child: Mapping[str, Any], append: tuple[str, ...] = ()) -> dict[str, Any]:
    """Child values win; tables merge key by key; arrays (of tables) replace, unless
    their key is in ``append``: then the child's tables are added after the parent's,
    and a child table naming a component the parent lists takes that one's place.

    A stage table whose ``name`` changes drops the parent's options, which
    belonged to the other component.
    """
    out = dict(base)
    for key, value in child.items():
        old = out.get(key)
        if key in append:
            out[key] = _appended(list(old or []), value)
        elif isinstance(old, dict) and isinstance(value, dict):
            if "name" in value and "name" in old and value["name"] != old["name"]:
                out[key] = dict(value)
            else:
                out[key] = merge(old, value)
        else:
            out[key] = value
    return out


def _appended(parent: list[Any], child: list[Any]) -> list[Any]:
    out = list(parent)
    for table in child:
        same = [i for i, kept in enumerate(out) if _name(kept) is not None and _name(kept) == _name(table)]
        if same:
            out[same[0]] = table  # the child's options for a component the parent lists
        else:
            out.append(table)
    return out


def parse_override(text: str, cwd: Path | None = None) -> tuple[list[str], Any]:
    """``"engine.base_lr=1e-4"`` -> (["engine", "base_lr"], 1e-4).

    The value is read as a TOML value (numbers, booleans, arrays, quoted
    strings); anything else is taken as a bare string.
    """
    if not isinstance(text, str):  # argparse turns `--set=--` into [] (it reads "--" as its own marker)
        raise UserError(f"--set {' '.join(map(str, text)) or '--'}: expected TABLE.KEY=VALUE, "
                        "e.g. --set engine.base_lr=1e-4")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Python keeps command-line bytes that are not UTF-8 as lone surrogates,
        # which no recipe, run folder or printout can hold.
        raise UserError(f"--set {text!r}: not UTF-8 text (the command line passed bytes that "
                        "are not UTF-8)") from None
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
    """Apply ``--set table.key=value`` overrides in order (``guard.0.max_norm`` indexes arrays)."""
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
