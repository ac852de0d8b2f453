"""The layers of docs/architecture.md hold: dependencies flow one way.

The contracts live in pyproject.toml ([tool.importlinter]); import-linter
builds the import graph of the installed source (function-local imports
included) and a backward import fails here, naming the chain.
"""

from __future__ import annotations

import logging.config
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_imports_follow_the_declared_layers(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    # lint_imports configures its logging with dictConfig, which by default disables every
    # logger that exists already (octfw's among them) for the rest of this test process.
    configure = logging.config.dictConfig
    monkeypatch.setattr(logging.config, "dictConfig",
                        lambda config: configure({**config, "disable_existing_loggers": False}))
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "BROKEN" not in report and "KEPT" in report


def test_validating_every_recipe_imports_no_heavy_package():
    """`octfw show`/`octfw list` and every recipe check stay fast: configs are attrs only.

    Each shipped recipe (every component of every stage among them) is
    loaded and validated in a fresh interpreter, then no numerical, imaging
    or cloud package may have been imported.
    """
    import subprocess
    import sys

    code = (
        "import sys, pathlib\n"
        "from octfw.recipe import load_recipe\n"
        "from octfw.registry import load_registry\n"
        "registry = load_registry(entry_points=[])\n"
        "for path in sorted(pathlib.Path('recipes').glob('*.toml')):\n"
        "    load_recipe(path, [], registry=registry)\n"
        "heavy = ('numpy', 'torch', 'torch_xla', 'pydicom', 'monai', 'zarr', 'dask', 'gcsfs', 'wandb',\n"
        "         'matplotlib', 'oct_converter', 'scipy')\n"
        "print('HEAVY', sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
