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
