"""One answer to "which checkpoint does a run stand at" (octfw.runs.checkpoint.run_checkpoint): export,
load_encoder, eval --checkpoints, replay and --resume auto take the same one, the fallback copy
of a final save that failed included; and a trainer started from Python holds its run folder
as ``octfw run`` does."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import octfw
from octfw.cli.main import main
from octfw.diagnostics.replay import replay
from octfw.engine.plan import plan_for_folder
from octfw.engine.preemption import StopRequests
from octfw.engine.trainer import SAVE_FAILED_EXIT_CODE, train
from octfw.evaluation.checkpoints import run_checkpoints
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.runs.checkpoint import fallback_storage, run_checkpoint
from octfw.runs.folder import create_run_dir
from octfw.storage.checkpoints import load_checkpoint
from octfw.storage.checkpoints import CheckpointStorage
from octfw.storage.owner import FolderInUse

from test_run_faults import _tmpfs, needs_root

EVAL_RECIPE = """
[run]
seed = 3
device = "cpu"

[[evaluator]]
name = "knn"
dataset = { name = "synthetic-oct", n_volumes = 12, labels = true, seed = 5 }
k = 3
bootstrap = 20
"""


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    first, second = a.state_dict(), b.state_dict()
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@needs_root
def test_a_run_whose_final_save_failed_is_exported_evaluated_and_loaded_at_its_fallback_step(
        tiny_recipe, tmp_path, capsys):
    # The measurement, small: the checkpoint disk fills after the step-2 save (room for one
    # checkpoint of ~10 MB), so the final state of step 4 goes to RUN/fallback and the run exits 74.
    with _tmpfs(tmp_path / "disk", "15m") as disk:
        sets = ["--set", f"checkpointer.dir={disk / 'ckpt'}", "--set", "engine.checkpoint_every_steps=2"]
        assert main(["run", str(tiny_recipe), *sets]) == SAVE_FAILED_EXIT_CODE
        [run_dir] = list((tmp_path / "runs" / "tiny").iterdir())
        fallback = run_dir / "fallback" / "step_00000004.pt"
        assert fallback.exists() and [p.name for p in (disk / "ckpt").glob("step_*.pt")] == ["step_00000002.pt"]
        capsys.readouterr()

        # octfw export RUN: the fallback's step 4, not the checkpointer's step 2.
        exported = tmp_path / "exported.pt"
        assert main(["export", str(run_dir), "--out", str(exported)]) == 0
        assert f"{fallback} (update step 4)" in capsys.readouterr().out
        from_file = octfw.load_encoder(exported)
        assert (from_file.info["update_step"], from_file.info["checkpoint"]) == (4, "step_00000004.pt")
        # octfw.load_encoder(RUN): the same encoder, without a file.
        from_run = octfw.load_encoder(run_dir)
        assert from_run.info["update_step"] == 4 and _same_weights(from_run, from_file)

        # octfw eval --checkpoints lists the fallback as the run's last step; `latest` is it.
        eval_recipe = tmp_path / "eval.toml"
        eval_recipe.write_text(EVAL_RECIPE, encoding="utf-8")
        assert main(["eval", str(run_dir), "--recipe", str(eval_recipe), "--checkpoints", "latest", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["steps"], report["locations"]) == ([4], [str(fallback)])
        assert [step for step, _ in run_checkpoints(run_dir, load_registry())[1]] == [2, 4]
        # octfw replay chooses among the same checkpoints: step 4 replays from step 2, the one before it.
        assert replay(run_dir, 4, load_registry(), report=lambda line: None)["from_step"] == 2

        # The disk grows: --resume auto writes the state to the checkpointer and exports RUN/encoder,
        # which is what the export above gave.
        subprocess.run(["mount", "-o", "remount,size=48m", str(disk)], check=True)
        assert main(["run", str(tiny_recipe), *sets, "--resume", "auto"]) == 0
        assert (disk / "ckpt" / "step_00000004.pt").exists() and not fallback.exists()
        finished = octfw.load_encoder(run_dir / "encoder")
        assert finished.info["update_step"] == 4 and _same_weights(finished, from_file)


def test_the_fallback_copy_is_taken_while_it_is_newer_than_the_checkpointers_newest_and_never_after(
        tiny_recipe, tmp_path):
    registry = load_registry()
    # Saves at step 4 (the first: never skipped for one in flight) and 6 (the final one, awaited).
    recipe = load_recipe(tiny_recipe, ["run.max_steps=6", "engine.checkpoint_every_steps=4"], registry)
    run_dir = create_run_dir(recipe, registry)
    train(recipe, registry, run_dir)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checkpointer = recipe.checkpointer.build(recipe.build_context(registry=registry, run_dir=run_dir))
    checkpoints = run_dir / "checkpoints"
    state_4, state_6 = (load_checkpoint(str(checkpoints / f"step_0000000{s}.pt")) for s in (4, 6))

    # As a run folder deleted under the run after step 4 leaves it, with its checkpoints inside:
    # nothing in the checkpointer, the state of step 4 in the fallback.
    in_fallback = fallback_storage(run_dir).save(4, state_4)
    for name in ("step_00000004.pt", "step_00000004.pt.sha256", "step_00000006.pt", "step_00000006.pt.sha256"):
        (checkpoints / name).unlink()
    assert run_checkpoint(run_dir, checkpointer) == (in_fallback, True)
    assert plan_for_folder(recipe, registry, run_dir, "auto").resume_from == in_fallback
    assert run_checkpoints(run_dir, registry)[1] == [(4, in_fallback)]
    assert octfw.load_encoder(run_dir).info["update_step"] == 4
    # replay of step 6 starts from the fallback's state and reproduces the logged loss.
    replayed = replay(run_dir, 6, registry, report=lambda line: None)
    assert replayed["from_step"] == 4 and replayed["loss"] == pytest.approx(logged[5]["loss"], rel=1e-6)

    # A later attempt saved step 6 to the checkpointer and was killed before its final save removed
    # the copy: the copy of step 4 is older now, and taking it would go backwards.
    newest = CheckpointStorage(str(checkpoints)).save(6, state_6)
    assert run_checkpoint(run_dir, checkpointer) == (newest, False)
    assert (plan := plan_for_folder(recipe, registry, run_dir, "auto")).resume_from == newest
    assert not plan.from_fallback
    assert run_checkpoints(run_dir, registry)[1] == [(6, newest)]
    assert octfw.load_encoder(run_dir).info["update_step"] == 6


def test_a_second_trainer_from_python_into_a_run_folder_in_use_is_refused(tiny_recipe):
    registry = load_registry()
    recipe = load_recipe(tiny_recipe, ["run.max_steps=100000"], registry)
    run_dir = create_run_dir(recipe, registry)
    stops, ended = StopRequests(), []
    first = threading.Thread(target=lambda: ended.append(train(recipe, registry, run_dir, stop_requests=stops)))
    first.start()
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text()):
            assert first.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        one_step = load_recipe(tiny_recipe, ["run.max_steps=1"], registry)  # refused or not: a short wait
        with pytest.raises(FolderInUse) as refused:
            train(one_step, registry, run_dir)
        assert str(refused.value).startswith(f"run folder {run_dir} is in use by pid ")
        assert "\n" not in str(refused.value)
    finally:
        stops.request("SIGTERM")  # as a stop signal: the step ends, the state is saved
        first.join(timeout=300)
    assert ended and ended[0].preempted
    assert (run_dir / "owner.lock").read_text() == ""  # released: the next trainer may take it
