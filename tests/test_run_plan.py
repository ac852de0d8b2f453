"""One place decides the run (engine/plan.py): the trainer receives a RunPlan and decides nothing
about folders or checkpoints; parsed command lines stay with the commands."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from conftest import TINY_RECIPE

OCTFW = Path(__file__).resolve().parents[1] / "octfw"


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_the_trainer_decides_nothing_about_folders_or_which_checkpoint():
    imported = _imported_names(OCTFW / "engine" / "trainer.py")
    deciding = {name for name in imported if name.startswith(("octfw.runs", "octfw.storage.owner"))
                or name.endswith((".create_run_dir", ".run_dirs", ".planned_run", ".resume_location"))}
    assert deciding == set()
    source = (OCTFW / "engine" / "trainer.py").read_text(encoding="utf-8")
    assert ".latest()" not in source  # which checkpoint to continue is the plan's


def test_parsed_command_lines_never_reach_the_engine_or_below():
    """argparse lives with the commands (octfw/cli/commands, the CLI, the helpers plugin commands
    share); the engine, recipes, storage, models and evaluation take values, never a namespace."""
    for package in ("engine", "recipe", "storage", "models", "evaluation", "diagnostics"):
        for path in (OCTFW / package).rglob("*.py"):
            assert "argparse" not in {n.split(".")[0] for n in _imported_names(path)}, path


def test_a_plan_for_a_folder_continues_its_fallback_copy_before_the_checkpointers_newest(tmp_path):
    """--resume auto in a folder with both: the fallback copy (the final state the checkpointer
    could not take) is newer by construction, and the plan says it must be uploaded."""
    import pytest
    import torch

    from octfw.engine.plan import plan_for_folder
    from octfw.engine.run_end import fallback_storage
    from octfw.display.errors import UserError
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    (tmp_path / "tiny.toml").write_text(TINY_RECIPE)
    registry = load_registry()
    recipe = load_recipe(tmp_path / "tiny.toml", [f"run.output_dir={tmp_path / 'runs'}"], registry)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = plan_for_folder(recipe, registry, run_dir, "auto")
    assert (plan.resume_from, plan.from_fallback, plan.processes.world_size) == (None, False, 1)
    saved = fallback_storage(run_dir).save(7, {"update_step": 7, "model": {}, "note": json.dumps("x")})
    plan = plan_for_folder(recipe, registry, run_dir, "auto", allow_recipe_change=True)
    assert (plan.resume_from, plan.from_fallback, plan.allow_recipe_change) == (saved, True, True)
    (tmp_path / "given.pt").write_bytes(b"a checkpoint the user names")
    explicit = plan_for_folder(recipe, registry, run_dir, str(tmp_path / "given.pt"))
    assert (explicit.resume_from, explicit.from_fallback) == (str(tmp_path / "given.pt"), False)
    assert isinstance(plan.processes.device, torch.device)
    (tmp_path / "given.pt").unlink()  # a checkpoint no process can read: refused before anything loads
    with pytest.raises(UserError, match="cannot be read by every process"):
        plan_for_folder(recipe, registry, run_dir, str(tmp_path / "given.pt"))


def test_resume_auto_reads_the_runs_and_their_checkpoints_once(tmp_path, monkeypatch):
    """Issue #59: the plan reads the recipe's runs and the checkpoint the chosen one stands at
    once (rank 0), decides, then holds the folder; the checkpoint is not asked again for the plan."""
    import octfw.engine.plan as plan_module
    from octfw.engine.backend import this_process
    from octfw.engine.distributed import Peers
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.checkpoint import fallback_storage, run_checkpoint
    from octfw.runs.folder import create_run_dir
    from octfw.storage.owner import is_owned

    (tmp_path / "tiny.toml").write_text(TINY_RECIPE)
    registry = load_registry()
    recipe = load_recipe(tmp_path / "tiny.toml", [f"run.output_dir={tmp_path / 'runs'}"], registry)
    older, newer = create_run_dir(recipe, registry), create_run_dir(recipe, registry)
    saved = fallback_storage(older).save(3, {"update_step": 3, "model": {}})
    asked = []
    monkeypatch.setattr(plan_module, "run_checkpoint",
                        lambda run_dir, checkpointer: asked.append(run_dir) or run_checkpoint(run_dir, checkpointer))

    processes = this_process("cpu")
    with plan_module.planned_run(recipe, registry, resume="auto", processes=processes,
                                 peers=Peers(processes)) as plan:
        assert (plan.run_dir, plan.resume_from, plan.from_fallback) == (older, saved, True)
        assert is_owned(older) is not None  # held while the block runs
    assert asked == [newer, older]  # newest first; each asked once, the chosen one not again
    assert is_owned(older) is None
