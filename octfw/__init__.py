"""octfw: a plugin-registry framework for self-supervised pretraining of 3D OCT models."""

__version__ = "0.1.0"
