"""octfw: a plugin-registry framework for self-supervised pretraining of 3D OCT models.

From Python (:mod:`octfw.api`)::

    import octfw
    result = octfw.train(octfw.load_recipe("recipes/quickstart.toml", ["run.max_steps=20"]))
    encoder = octfw.load_encoder(octfw.export(result.run_dir, "encoder.pt"))
"""

from typing import Any

from octfw.api import TrainResult, evaluate, export, load_recipe, train
from octfw.errors import RecipeError, RunNotFinished, UserError
from octfw.version import __version__

__all__ = ["__version__", "load_recipe", "train", "evaluate", "export", "load_encoder", "TrainResult",
           "UserError", "RecipeError", "RunNotFinished"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import octfw` (and `octfw list`) never imports torch.
    if name == "load_encoder":
        from octfw.exports.pretrained import load_encoder

        return load_encoder
    raise AttributeError(f"module 'octfw' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
