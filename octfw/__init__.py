"""octfw: a plugin-registry framework for self-supervised pretraining of 3D OCT models."""

from typing import Any

from octfw.version import __version__

__all__ = ["__version__", "load_encoder"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import octfw` (and `octfw list`) never imports torch.
    if name == "load_encoder":
        from octfw.encoder import load_encoder

        return load_encoder
    raise AttributeError(f"module 'octfw' has no attribute {name!r}")
