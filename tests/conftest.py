"""Shared fixtures: a per-session cache folder, a fresh registry, tiny recipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def make_dist(root: Path, dist: str, module: str, code: str, version: str = "1.2.3") -> None:
    """An installed distribution as pip leaves it: a module plus a dist-info
    folder whose entry_points.txt names it in the group 'octfw'."""
    (root / f"{module}.py").write_text(textwrap.dedent(code), encoding="utf-8")
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[octfw]\n{module} = {module}\n")


@pytest.fixture(scope="session", autouse=True)
def _octfw_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("octfw-cache")
    os.environ["OCTFW_CACHE_DIR"] = str(cache)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    # gcsfs reads this at import: without it every new bucket costs a 60 s gRPC probe.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return cache


@pytest.fixture(scope="session", autouse=True)
def _octfw_console_logging() -> None:
    """octfw's console handler, as ``octfw`` installs it: tests that train in this
    process see the same ``octfw: warning: ...`` lines on stderr as a user."""
    from octfw.display.logs import setup_console_logging

    setup_console_logging()


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


@pytest.fixture
def gcs(monkeypatch):
    """A running GCS emulator on 127.0.0.1 with the client environment set."""
    from gcs_emulator import GCSEmulator

    emulator = GCSEmulator().start()
    for key, value in emulator.env().items():
        monkeypatch.setenv(key, value)
    yield emulator
    emulator.stop()


@pytest.fixture
def install_plugins(monkeypatch):
    """Load plugin modules (name -> source) through entry points, as pip-installed packages'
    would be, and return the registry that holds them beside the built-ins."""
    import importlib.metadata as metadata
    import sys
    import types

    from octfw.registry import DISABLE_ENV, load_registry

    monkeypatch.delenv(DISABLE_ENV, raising=False)

    def install(**sources: str):
        entries = []
        for name, source in sources.items():
            module = types.ModuleType(name)
            exec(compile(source, f"{name}.py", "exec"), module.__dict__)
            monkeypatch.setitem(sys.modules, name, module)
            entries.append(metadata.EntryPoint(name=name, value=name, group="octfw"))
        return load_registry(entry_points=entries)

    return install


def run_xla_script(name: str) -> dict:
    """The JSON line a script of tests/xla/ prints last, run on torch_xla's CPU device in a process
    of its own (importing torch_xla patches torch for the whole process)."""
    script = Path(__file__).parent / "xla" / name
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
