"""The installed octfw version (the one place it is written besides pyproject.toml)."""

__version__ = "0.1.0"
