"""User mistakes through the real command line: one ``octfw: error:`` line naming the
file, key or value, exit code 2, and no traceback (issue #26, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import TINY_RECIPE

REPO = Path(__file__).resolve().parents[1]


def octfw(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``octfw ARGS`` in a subprocess, run in ``cwd`` with its caches under it."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), "PJRT_DEVICE": "CPU",
                   "OCTFW_CACHE_DIR": str(cwd / "cache"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "octfw.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=environment, timeout=300)


def refused(out: subprocess.CompletedProcess) -> str:
    """The one ``octfw: error:`` line of a command that refused a user mistake."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("octfw: error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- 1. a recipe that is not UTF-8 text -------------------------------------


def a_checkpoint(path: Path) -> Path:
    """A real torch checkpoint: a zip of pickles, not text."""
    import torch

    torch.save({"model": {"weight": torch.arange(64, dtype=torch.float32)}}, path)
    return path


def test_a_checkpoint_given_as_the_recipe_is_named_not_a_recipe(tmp_path):
    checkpoint = a_checkpoint(tmp_path / "step_00000004.pt")
    line = refused(octfw("show", str(checkpoint), cwd=tmp_path))
    assert line.startswith(f"octfw: error: {checkpoint}: not a recipe: byte 0x")
    assert "is not UTF-8 text" in line


def test_a_recipe_that_extends_a_file_that_is_not_utf8_names_that_file(tmp_path):
    a_checkpoint(tmp_path / "base.pt")
    child = write(tmp_path / "child.toml", 'extends = "base.pt"\n')
    line = refused(octfw("check", str(child), cwd=tmp_path))
    assert line.startswith(f"octfw: error: {tmp_path / 'base.pt'}: not a recipe")


# --- 2. a recipe with a UTF-8 byte order mark -------------------------------


def test_a_recipe_with_a_utf8_byte_order_mark_reads_like_one_without(tmp_path):
    plain = write(tmp_path / "plain.toml", TINY_RECIPE)
    marked = tmp_path / "marked.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + TINY_RECIPE.encode("utf-8"))
    without, with_mark = octfw("show", str(plain), cwd=tmp_path), octfw("show", str(marked), cwd=tmp_path)
    assert (without.returncode, with_mark.returncode) == (0, 0), with_mark.stderr
    assert with_mark.stdout == without.stdout
