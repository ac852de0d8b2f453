"""tools/parity/_reference.py's ``run_train_step``: the V-JEPA fixtures take their targets,
predictions and losses from the reference's own ``train_step`` (functions and forward block of
its ``train.py``), run from the checkout's text; here on a small file of the same shape, so that
the test needs no reference checkout."""

from __future__ import annotations

import sys
import textwrap
import traceback
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "parity"))
from _reference import run_train_step  # noqa: E402

TRAIN = '''
def main(args):
    scale = 2

    def train_step():
        _new_lr = scheduler.step()

        def forward(x):
            return [xi * scale for xi in x]

        def loss_fn(z):
            return sum(z) / len(z)

        with torch.cuda.amp.autocast(dtype=dtype, enabled=mixed_precision):
            z = forward(clips)
            loss = loss_fn(z)

        optimizer.step()
'''


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "train.py").write_text(textwrap.dedent(text))
    return tmp_path


def test_the_train_steps_functions_and_forward_block_run_as_written_and_nothing_else(tmp_path):
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"{name} of the optimiser or scheduler was run")

    root = write(tmp_path, TRAIN)
    out = run_train_step(root, "app/train.py", {"clips": [1.0, 3.0], "scale": 3,
                                                 "scheduler": Untouchable(), "optimizer": Untouchable()})
    assert out["z"] == [3.0, 9.0] and out["loss"] == 6.0  # the file's loss_fn, with main's `scale` given


def test_a_traceback_points_into_the_reference_file(tmp_path):
    root = write(tmp_path, TRAIN)
    with pytest.raises(TypeError) as raised:
        run_train_step(root, "app/train.py", {"clips": [1.0, None], "scale": 3})
    last = traceback.extract_tb(raised.value.__traceback__)[-1]
    assert last.filename == str(root / "app" / "train.py")
    assert last.line == "return [xi * scale for xi in x]"  # the file's own line, found by its number


def test_a_file_without_one_forward_block_is_refused_by_name(tmp_path):
    root = write(tmp_path, TRAIN.replace("with torch.cuda.amp.autocast(dtype=dtype, enabled=mixed_precision):",
                                         "if True:"))
    with pytest.raises(SystemExit, match=r"train.py: train_step has 0 autocast blocks, expected one"):
        run_train_step(root, "app/train.py", {})
