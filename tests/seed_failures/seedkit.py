"""Helpers shared by the seed-failure tests: tiny recipes, in-process CLI calls, runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TINY_RECIPE

REPO = Path(__file__).resolve().parents[2]


def write_tiny(folder: Path, extra: str = "", name: str = "tiny.toml") -> Path:
    """TINY_RECIPE (runs go to <folder>/runs) plus extra TOML tables."""
    path = folder / name
    path.write_text(TINY_RECIPE + "\n" + extra, encoding="utf-8")
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``octfw ARGS`` in this process: (exit code, stdout, stderr)."""
    from octfw.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_subprocess(folder: Path, *args: str, env: dict | None = None,
                   extra_path: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m octfw.cli ARGS`` in a fresh process (for anything that may import torch_xla)."""
    paths = [str(extra_path)] if extra_path else []
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(REPO)]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "octfw.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=folder, env=full_env, timeout=600)


def train(recipe_path: Path, overrides=(), resume: str | None = None):
    """Train in this process; (RunSummary, run directory)."""
    from octfw.engine.trainer import train as run_training
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    registry = load_registry()
    recipe = load_recipe(recipe_path, list(overrides), registry)
    run_dir = create_run_dir(recipe, registry)
    return run_training(recipe, registry, run_dir, resume=resume), run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def install_plugin(monkeypatch, tmp_path: Path, module: str, code: str) -> Path:
    """A test plugin distribution on sys.path (found through the 'octfw' entry-point group)."""
    import importlib
    import sys as _sys

    from conftest import make_dist

    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    make_dist(site, f"octfw-{module.replace('_', '-')}", module, code)
    monkeypatch.syspath_prepend(str(site))
    _sys.modules.pop(module, None)
    importlib.invalidate_caches()
    return site
