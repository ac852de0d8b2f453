"""The command line end to end, in real subprocesses: list, show, check, run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


def octfw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octfw.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)


def test_version():
    out = octfw("--version")
    assert out.returncode == 0 and out.stdout.strip() == "octfw 0.1.0"


def test_list_shows_every_stage_with_origin():
    out = octfw("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["STAGE", "NAME", "DISTRIBUTION", "VERSION", "SUMMARY"]
    stages = {line.split()[0] for line in lines[1:]}
    assert stages == {"dataset", "transform", "model", "scheduler", "guard", "logger", "checkpointer", "evaluator"}
    assert any(line.split()[:3] == ["model", "vjepa3d", "octfw"] for line in lines)


def test_list_json_and_stage_filter():
    out = octfw("list", "--stage", "guard", "--json")
    rows = json.loads(out.stdout)["components"]
    assert {"nan-skip", "grad-clip", "lr-positive", "loss-spike"} <= {r["name"] for r in rows}
    assert all(r["stage"] == "guard" and r["distribution"] == "octfw" for r in rows)


def test_list_component_options_with_types_defaults_and_docs():
    out = octfw("list", "--stage", "engine" if False else "model", "--name", "vjepa3d")
    assert out.returncode == 0, out.stderr
    assert "model vjepa3d (octfw 0.1.0)" in out.stdout
    assert "patch_size (tuple[int, int, int], default (4, 16, 16))" in out.stdout
    options = json.loads(octfw("list", "--stage", "model", "--name", "vjepa3d", "--json").stdout)["options"]
    preset = next(o for o in options if o["key"] == "preset")
    assert preset["default"] == "small" and preset["doc"]


def test_list_unknown_component_is_a_user_error():
    out = octfw("list", "--stage", "model", "--name", "vjepa")
    assert out.returncode == 2
    assert out.stderr.strip() == ("octfw: error: unknown model component 'vjepa' (did you mean 'vjepa3d'?); "
                                  "available: mae3d, vjepa3d")


def test_show_prints_resolved_recipe_with_defaults():
    out = octfw("show", "recipes/quickstart.toml", "--set", "engine.base_lr=1e-4")
    assert out.returncode == 0, out.stderr
    assert "base_lr = 0.0001" in out.stdout
    assert "domain_sampling = \"natural\"" in out.stdout  # a default the recipe does not write
    assert f'output_dir = "{REPO / "runs"}"' in out.stdout


def test_show_prints_every_option_the_unset_and_derived_ones_as_comments_and_loads_back(tmp_path, registry):
    import attrs

    from octfw.recipe.config import EngineConfig, RunConfig
    from octfw.recipe import load_recipe

    out = octfw("show", "recipes/quickstart.toml", "--set", f"run.cache_dir={tmp_path}/cache")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for table, cls in (("run", RunConfig), ("engine", EngineConfig)):
        body = lines[lines.index(f"[{table}]") + 1:]
        body = body[:body.index("")]
        keys = [match[1] for line in body if (match := re.match(r"(?:# )?(\w+)(?: = |  \()", line))]
        assert keys == list(attrs.fields_dict(cls)), table
    assert '# name = "quickstart"  (derived: the recipe file\'s name)' in lines
    assert "# max_steps  (unset: the run lasts run.epochs = 5 passes over the dataset)" in lines
    assert f'cache_dir = "{tmp_path}/cache"' in lines  # set: a value, not a comment
    assert "# num_workers = 0  (derived: 0 on the cpu device, where training itself uses the cores)" in lines
    assert any(line.startswith("# dir  (folder for checkpoints") for line in lines)  # a component's option
    shown = tmp_path / "shown.toml"
    shown.write_text(out.stdout)
    assert (load_recipe(shown, [], registry).to_dict()
            == load_recipe(REPO / "recipes/quickstart.toml", [f"run.cache_dir={tmp_path}/cache"], registry).to_dict())

    lines = octfw("show", "recipes/multi_domain.toml").stdout.splitlines()  # run.device = "auto"
    assert any(line.startswith("# cache_dir = ") and line.endswith("(derived: $OCTFW_CACHE_DIR, else ~/.cache/octfw)")
               for line in lines)
    assert ("# num_workers  (derived: 0 on the cpu device; on cuda and xla the cores this process may use (its "
            "share of the host's) minus one, at most 8; octfw run logs the number)") in lines


def test_bad_recipe_exits_2_with_one_line_per_problem_and_no_traceback(write_recipe):
    path = write_recipe('[run]\nmax_steps = 0\n[engine]\nbase_lr = "x"\n')
    out = octfw("check", str(path))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0] == f"octfw: error: {path}: 5 problems"
    assert "  run.max_steps: must be > 0, got 0" in lines
    assert "  engine.base_lr: expected a number, got the string 'x'" in lines


def test_debug_shows_the_traceback(write_recipe):
    out = octfw("--debug", "check", str(write_recipe("[run]\nmax_steps = 0\n")))
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_check_reports_every_stage_boundary():
    out = octfw("check", "recipes/quickstart.toml")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "transform oct-standard: context [1, 16, 64, 64] float32, target [1, 16, 64, 64] float32, " \
           "context_idx [26] int64, target_idx [38] int64" in text
    assert "batch     context [4, 1, 16, 64, 64] float32" in text
    assert "model     vjepa3d: loss" in text and "trainable parameters" in text
    assert "schedule  cosine-no-restart: 60 update steps (12 per epoch)" in text
    assert text.strip().endswith("check passed")


def test_check_points_at_missing_data_of_the_big_recipes():
    out = octfw("check", "recipes/multi_domain.toml")
    assert out.returncode == 2
    assert "/data/oct/multi_domain/manifest.csv" in out.stderr and "Traceback" not in out.stderr


def test_quickstart_runs_end_to_end(tmp_path):
    out = octfw("run", "recipes/quickstart.toml", "--set", f"run.output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    run_dir = next((tmp_path / "quickstart").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == summary["total_update_steps"] == 60
    assert summary["skipped_updates"] == 0 and summary["quarantined"] == 0
    assert summary["last_loss"] < summary["first_loss"]
    assert Path(summary["checkpoint"]).exists()
    for name in ("recipe.toml", "versions.json", "git.json", "metrics.jsonl"):
        assert (run_dir / name).exists(), name
    versions = json.loads((run_dir / "versions.json").read_text())
    assert versions["octfw"] == "0.1.0" and versions["torch"]
    assert "training summary" in out.stdout and "60/60" in out.stdout
    assert "data wait" in out.stdout and "num_workers" not in out.stdout  # no hint against its own defaults
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(5, 61, 5))
    assert {"loss", "lr", "grad_norm", "skipped_updates", "samples_per_s", "loss/heidelberg"} <= set(lines[0])


def test_check_reports_the_global_batch_of_a_pod_layout(tiny_recipe, capsys):
    from octfw.cli.main import main

    assert main(["check", str(tiny_recipe), "--processes", "2", "--devices-per-process", "2",
                 "--set", "engine.per_device_batch=1"]) == 0
    out = capsys.readouterr().out
    assert ("layout    global batch 4 = per_device_batch 1 x 4 devices x grad_accum_steps 1; "
            "2 processes x 2 devices: each process loads 2 samples per micro-step") in out
    assert main(["check", str(tiny_recipe), "--processes", "0"]) == 2
    assert "--processes 0: must be at least 1" in capsys.readouterr().err


def test_list_name_finds_the_component_without_its_stage(capsys):
    from octfw.cli.main import main

    assert main(["list", "--name", "nan-skip"]) == 0
    assert capsys.readouterr().out.startswith("guard nan-skip (octfw ")
    assert main(["list", "--name", "nan-skp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "octfw: error: --name 'nan-skp': no such component (did you mean 'nan-skip'?); octfw list shows them all"


def test_a_reader_that_stops_early_ends_every_command_quietly(tiny_recipe):
    """`octfw list | head -2`: the read end of stdout is closed before octfw writes, so every
    write fails; the command exits 141 (as a shell reports SIGPIPE) with nothing on stderr."""
    for args in (["list"], ["show", str(tiny_recipe)]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            proc = subprocess.run([sys.executable, "-m", "octfw.cli", *args], stdout=write_end,
                                  stderr=subprocess.PIPE, text=True, cwd=REPO,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        finally:
            os.close(write_end)
        assert (proc.returncode, proc.stderr) == (141, ""), args


def test_a_first_check_says_it_writes_the_cohort_and_what_the_slow_step_is(tiny_recipe, tmp_path, monkeypatch,
                                                                          capsys):
    from octfw.cli.main import main

    monkeypatch.setenv("OCTFW_CACHE_DIR", str(tmp_path / "fresh-cache"))
    assert main(["check", str(tiny_recipe)]) == 0
    err = capsys.readouterr().err
    assert (f"writing the synthetic cohort (8 volumes, small sizes) once, to {tmp_path}/fresh-cache/synthetic-oct/"
            in err and "; later commands reuse it" in err)
    assert ("one forward and backward of vjepa3d on the CPU (2 samples, 8 patches each): a full-size model "
            "takes minutes here") in err
    assert main(["check", str(tiny_recipe)]) == 0
    assert "writing the synthetic cohort" not in capsys.readouterr().err  # written once, then reused


def test_check_previews_a_pod_recipe_without_its_data_given_a_length(capsys):
    """The seeds' recipe points at /data/oct/..., absent here: --steps previews what needs no data."""
    from octfw.cli.main import main

    recipe = REPO / "recipes" / "multi_domain.toml"
    assert main(["check", str(recipe), "--processes", "4", "--devices-per-process", "4", "--steps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "layout    global batch 32 = per_device_batch 1 x 16 devices x grad_accum_steps 2" in out
    assert "schedule  cosine-no-restart: 1000 update steps (--steps)" in out
    assert "no data was read" in out and "check passed" not in out
    # Without --steps the same check reads the data, which is not here: refused in one line.
    assert main(["check", str(recipe), "--processes", "4", "--devices-per-process", "4"]) == 2
