"""Run folders started at the same moment: each start makes its own folder, by an exclusive
mkdir, and records its own sequence number, claimed under a lock on the recipe's folder; a
start never removes a folder it did not make (issue 48, item 4).

The race is made for real twice: threads calling :func:`octfw.runs.folder.create_run_dir` at
once, and 8 ``octfw run`` processes of one recipe started together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import TINY_RECIPE
from octfw.display.errors import UserError
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.runs.folder import RUN_FILE, create_run_dir, run_dirs, run_sequence

REPO = Path(__file__).resolve().parents[1]


def _started_together(count: int, start) -> list:
    """``start()`` in ``count`` threads released by one barrier; each thread's result or exception."""
    barrier = threading.Barrier(count)
    results: list = [None] * count

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = start()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def test_starts_at_the_same_moment_get_their_own_folders_and_sequence_numbers(tiny_recipe):
    registry = load_registry()
    recipe = load_recipe(tiny_recipe, [], registry)
    made = _started_together(8, lambda: create_run_dir(recipe, registry))
    assert not [r for r in made if isinstance(r, BaseException)], made  # no start refused
    assert len(set(made)) == 8 and all(folder.is_dir() for folder in made)  # 8 folders, none removed
    assert sorted(run_sequence(folder) for folder in made) == list(range(1, 9))
    assert all((folder / "recipe.toml").exists() for folder in made)
    assert run_dirs(recipe) == sorted(made, key=run_sequence, reverse=True)
    # Another start now comes after all of them.
    assert run_sequence(create_run_dir(recipe, registry)) == 9


def test_a_failed_start_removes_only_its_own_folder(tiny_recipe, monkeypatch):
    """The folder a start made is removed when it cannot be written; the folder of another run
    that took the same name first is left as it was."""
    import octfw.runs.folder as rundir

    registry = load_registry()
    recipe = load_recipe(tiny_recipe, [], registry)
    other = create_run_dir(recipe, registry)  # a run started in this same second, by someone else
    before = sorted(p.name for p in other.iterdir())

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir, "git_info", full_disk)
    with pytest.raises(UserError, match="cannot write the run folder"):
        create_run_dir(recipe, registry)
    assert sorted(p.name for p in other.iterdir()) == before and run_sequence(other) == 1
    assert [p for p in other.parent.iterdir()] == [other]  # the failed start's folder is gone


@pytest.mark.slow
def test_eight_octfw_runs_of_one_recipe_started_at_once_finish_in_eight_folders(tmp_path):
    """8 real ``octfw run`` of one recipe, started together into one output folder: 8 runs that
    finish, each in its own folder with its own sequence number, metrics and checkpoint."""
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(TINY_RECIPE)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "octfw.cli", "run", str(recipe), f"--set=run.output_dir={tmp_path / 'runs'}",
               "--set=run.max_steps=2", "--set=engine.log_every_steps=1"]
    processes = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(8)]
    outcomes = [(p.wait(timeout=600), p.communicate()[1]) for p in processes]
    assert [code for code, _ in outcomes] == [0] * 8, [err[-2000:] for code, err in outcomes if code]
    folders = [p for p in (tmp_path / "runs" / "tiny").iterdir()]
    assert len(folders) == 8, folders
    assert sorted(run_sequence(folder) for folder in folders) == list(range(1, 9))
    assert len({json.loads((folder / RUN_FILE).read_text())["id"] for folder in folders}) == 8
    for folder in folders:
        steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2], folder  # this run's own steps, written by it alone
        assert [p.name for p in (folder / "checkpoints").glob("step_*.pt")] == ["step_00000002.pt"], folder
        assert json.loads((folder / "summary.json").read_text())["update_steps"] == 2
