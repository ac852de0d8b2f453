"""octfw: a plugin-registry framework for self-supervised pretraining of 3D OCT models.

From Python (:mod:`octfw.api`)::

    import octfw
    result = octfw.train(octfw.load_recipe("recipes/quickstart.toml", ["run.max_steps=20"]))
    encoder = octfw.load_encoder(octfw.export(result.run_dir, "encoder.pt"))
"""

import importlib
import sys
from typing import Any

from octfw.api import TrainResult, evaluate, export, load_recipe, train
from octfw.display.errors import RecipeError, RunNotFinished, UserError
from octfw.hookspecs import hookimpl
from octfw.version import __version__

__all__ = ["__version__", "load_recipe", "train", "evaluate", "export", "load_encoder", "TrainResult",
           "UserError", "RecipeError", "RunNotFinished", "hookimpl"]

#: Modules a plugin written for octfw 0.1 imports by their old place, before they moved into the
#: packages they serve: the old names stay importable and are the same modules (all light).
MOVED_MODULES = {"octfw.fields": "octfw.recipe.fields", "octfw.errors": "octfw.display.errors",
                 "octfw.arguments": "octfw.cli.arguments"}
for _old, _new in MOVED_MODULES.items():
    # as an import would: in sys.modules (`import octfw.fields`), and an attribute of the package
    globals()[_old.rpartition(".")[2]] = sys.modules.setdefault(_old, importlib.import_module(_new))
del _old, _new


def __getattr__(name: str) -> Any:
    # Lazy, so that `import octfw` (and `octfw list`) never imports torch.
    if name == "load_encoder":
        from octfw.exports.pretrained import load_encoder

        return load_encoder
    raise AttributeError(f"module 'octfw' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
