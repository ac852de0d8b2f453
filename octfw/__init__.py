"""octfw: a plugin-registry framework for self-supervised pretraining of 3D OCT models."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `import octfw` (and `octfw list`) never imports torch.
    if name == "load_encoder":
        from octfw.export import load_encoder

        return load_encoder
    raise AttributeError(f"module 'octfw' has no attribute {name!r}")
