"""Shared fixtures: a per-session cache folder, a fresh registry, tiny recipes."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

# A tiny, fast recipe used across engine and CLI tests: 8 synthetic volumes,
# 8 x 32 x 32 voxels, 2 x 2 x 2 patches, a few update steps on the CPU.
TINY_RECIPE = """
[run]
seed = 0
output_dir = "runs"
max_steps = 4
device = "cpu"

[engine]
per_device_batch = 2
grad_accum_steps = 1
base_lr = 1e-3
log_every_steps = 1

[dataset]
name = "synthetic-oct"
n_volumes = 8

[transform]
name = "oct-standard"
image_size = [8, 32, 32]

[model]
name = "vjepa3d"
preset = "tiny"
patch_size = [4, 16, 16]

[scheduler]
name = "cosine-no-restart"
warmup = 1

[[logger]]
name = "jsonl"
"""


@pytest.fixture(scope="session", autouse=True)
def _octfw_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("octfw-cache")
    os.environ["OCTFW_CACHE_DIR"] = str(cache)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    return cache


@pytest.fixture
def registry():
    from octfw.registry import load_registry

    return load_registry()


@pytest.fixture
def write_recipe(tmp_path: Path):
    """Write a recipe file (TOML text, dedented) and return its path."""

    def write(text: str, name: str = "recipe.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write


@pytest.fixture
def tiny_recipe(write_recipe) -> Path:
    return write_recipe(TINY_RECIPE, "tiny.toml")
