"""What cannot be resumed exactly is refused, naming the difference; nothing is half-loaded.
Every refusal is one line, and each hint it prints is a run the next check takes: the tests
read the hint from the printed line, follow it, and the run finishes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_multiprocess_faults import checkpoint_steps, job  # noqa: F401 - job: the fixture
from octfw.cli.main import main
from octfw.cli.exit_codes import USER_ERROR


def refusal(err: str) -> str:
    """The one line a refusal printed, last (no line of it continued below, no newline escaped into it)."""
    [line] = [line for line in err.splitlines() if line.startswith("octfw: error:")]
    assert err.rstrip("\n").splitlines()[-1] == line and "\\n" not in line and "Traceback" not in err, err
    return line


def pinned_settings(line: str) -> list[str]:
    """``--set`` arguments for the settings a refusal says to pin (``pin engine.a = 1 and engine.b = 2``)."""
    hint = re.search(r"pin ((?:engine\.\w+ = \d+(?: and )?)+)", line)
    assert hint, line
    return [arg for key, value in re.findall(r"(engine\.\w+) = (\d+)", hint.group(1))
            for arg in ("--set", f"{key}={value}")]


def accepting_flag(line: str) -> str:
    """The flag a refusal of a recipe change names to accept it."""
    hint = re.search(r"accept them with (--[\w-]+)", line)
    assert hint, line
    return hint.group(1)


@pytest.fixture
def checkpoint(tiny_recipe, tmp_path) -> Path:
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=2"]) == 0
    [run_dir] = list((tmp_path / "runs" / "tiny").iterdir())
    return Path(json.loads((run_dir / "summary.json").read_text())["checkpoint"])


@pytest.mark.parametrize("override, message", [
    ("model.depth=3", "trained with another model (model.depth None -> 3)"),
    ("engine.per_device_batch=1", "global batch of 2 samples, this run has 1"),
    ("dataset.n_volumes=10", "dataset had 8 samples, this one has 10"),
])
def test_a_checkpoint_of_another_run_shape_is_refused(tiny_recipe, checkpoint, capsys, override, message):
    code = main(["run", str(tiny_recipe), "--set", override, "--resume", str(checkpoint)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_checkpoint_cut_short_is_a_user_error(tiny_recipe, checkpoint, tmp_path, capsys):
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    code = main(["run", str(tiny_recipe), "--resume", str(truncated)])
    err = capsys.readouterr().err
    assert code == 2 and f"checkpoint {truncated} cannot be read" in err and "cut short" in err


def test_the_same_run_shape_resumes(tiny_recipe, checkpoint, capsys):
    assert main(["run", str(tiny_recipe), "--resume", str(checkpoint), "--set", "run.max_steps=2",
                 "--set", "engine.log_every_steps=2"]) == 0
    assert "resumed with a changed recipe: engine.log_every_steps: 1 -> 2" in capsys.readouterr().err


def as_written_before(checkpoint: Path, drop_group: bool = False) -> None:
    """``checkpoint`` as octfw wrote it before model.init_channels and model.predictor_warmup_steps
    existed (its recorded recipe without them), its SHA-256 written again."""
    import hashlib

    import torch

    state = torch.load(checkpoint, weights_only=True)
    for key in ("init_channels", "predictor_warmup_steps"):
        del state["recipe"]["model"][key]
    if drop_group:  # as if the model had grouped its parameters otherwise then
        state["optimizer"]["param_groups"].pop()
    torch.save(state, checkpoint)
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    checkpoint.with_name(checkpoint.name + ".sha256").write_text(f"{digest}  {checkpoint.name}\n")


def test_a_checkpoint_from_before_later_model_keys_resumes(tiny_recipe, checkpoint, capsys):
    """A key added since (how init meets RGB weights, the predictor warm-up) is no change of the
    model for a checkpoint that predates it: an upgrade does not strand a run."""
    as_written_before(checkpoint)
    assert main(["run", str(tiny_recipe), "--resume", str(checkpoint), "--set", "run.max_steps=2"]) == 0
    err = capsys.readouterr().err
    assert "model.init_channels: (not set) -> 'auto'" in err and "changes training" not in err  # listed, taken
    assert "predictor_warmup_steps" not in err  # unset trains as before it existed


def test_an_optimizer_grouped_otherwise_is_one_line_with_the_way_out(tiny_recipe, checkpoint, capsys):
    as_written_before(checkpoint, drop_group=True)
    assert main(["run", str(tiny_recipe), "--resume", str(checkpoint), "--set", "run.max_steps=2"]) == USER_ERROR
    line = refusal(capsys.readouterr().err)
    assert "the checkpoint's optimizer has 1 parameter groups, this model makes 2" in line
    assert "set model.predictor_warmup_steps = 0 to continue it as it trained" in line


def test_a_longer_run_is_a_change_of_training_refused_unless_accepted(tiny_recipe, checkpoint, capsys):
    longer = ["run", str(tiny_recipe), "--set", "run.max_steps=3", "--resume", str(checkpoint)]
    assert main(longer) == USER_ERROR
    line = refusal(capsys.readouterr().err)
    assert "the checkpoint was trained with another recipe" in line and "training: run.max_steps: 2 -> 3 (" in line
    assert main([*longer, accepting_flag(line)]) == 0
    assert "run.max_steps: 2 -> 3 (changes training; accepted)" in capsys.readouterr().err


def test_a_pinned_global_batch_other_than_the_checkpoints_is_refused_and_the_printed_pin_resumes(
        tiny_recipe, checkpoint, capsys):
    resume = ["run", str(tiny_recipe), "--resume", str(checkpoint), "--set", "run.max_steps=2"]
    assert main([*resume, "--set", "engine.global_batch=4"]) == USER_ERROR
    line = refusal(capsys.readouterr().err)
    assert "trained with a global batch of 2 samples, this run pins engine.global_batch = 4" in line
    pin = pinned_settings(line)
    assert main([*resume, *pin, "--set", "run.max_steps=3"]) == USER_ERROR  # a real change beside it: that alone
    line = refusal(capsys.readouterr().err)
    assert "would change its training: run.max_steps: 2 -> 3 (" in line and "engine." not in line
    assert main([*resume, *pin]) == 0  # the batch it trained at: not a change of training
    assert ("resumed with a changed recipe: engine.global_batch: (not set) -> 2 (restates the global batch it "
            "trained at)") in capsys.readouterr().err


def test_a_key_set_to_its_default_is_no_change(tiny_recipe, checkpoint, capsys):
    """The recipes are compared resolved, every default filled in: saying the default is saying nothing new."""
    assert main(["run", str(tiny_recipe), "--resume", str(checkpoint), "--set", "run.max_steps=2",
                 "--set", "engine.weight_decay=0.05", "--set", "engine.domain_sampling=natural"]) == 0
    assert "resumed with a changed recipe" not in capsys.readouterr().err


def test_turning_on_activation_checkpointing_resumes(tiny_recipe, checkpoint, capsys):
    """It changes how memory is spent, not the weights or the numbers: the way
    out of an out-of-memory crash is allowed on --resume."""
    assert main(["run", str(tiny_recipe), "--set", "model.activation_checkpointing=true", "--set", "run.max_steps=2",
                 "--resume", str(checkpoint)]) == 0


@pytest.mark.slow
def test_a_two_process_run_resumed_on_one_follows_each_printed_hint_to_its_last_step(job):
    """The device-count refusal of a real job (2 processes, gloo on the CPU) resumed with one
    process: issue 58's 4 then 2, with the same refusal and hints at half the processes. The
    run accumulates 2 micro-steps, so pinning its global batch also takes grad_accum_steps back
    to 1; neither is a change of training. The refusal is one line under the launcher too. Each
    hint, read from the printed line, is a run that finishes: every update step once, none twice."""
    shape = ("--set=engine.grad_accum_steps=2", "--set=run.max_steps=6", "--set=engine.checkpoint_every_steps=2")
    first = job.run("two", *shape)  # global batch 1 x 2 devices x 2 = 4
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = job.run_dir("two") / "checkpoints" / checkpoint_steps(job.run_dir("two"))[0]  # update step 2
    resume = (*shape, "--resume", str(checkpoint))

    refused = job.run("one", *resume, nproc=1)  # under the launcher, which prints the job's one line
    assert refused.returncode == USER_ERROR, refused.stderr[-3000:]
    line = refusal(refused.stderr)
    assert "trained on 2 devices (global batch 4), this run has 1 device (global batch 2)" in line
    launch = re.search(r"run it on (\d+) devices? as it was launched \(--nproc-per-node\)", line)
    assert launch, line
    pin = pinned_settings(line)
    assert pin == ["--set", "engine.global_batch=4", "--set", "engine.grad_accum_steps=1"]

    pinned = job.run("pinned", *resume, *pin, nproc=None)  # one process, no launcher: the cheaper start
    assert pinned.returncode == 0, pinned.stderr[-3000:]
    for restated in ("engine.global_batch: (not set) -> 4", "engine.grad_accum_steps: 2 -> 1"):
        assert f"{restated} (restates the global batch it trained at)" in pinned.stderr
    relaunched = job.run("relaunched", *resume, nproc=int(launch.group(1)))  # 1 device per process on the CPU
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    for out in ("pinned", "relaunched"):
        steps = [json.loads(line)["step"] for line in (job.run_dir(out) / "metrics.jsonl").read_text().splitlines()]
        assert steps == [3, 4, 5, 6], out
        assert json.loads((job.run_dir(out) / "summary.json").read_text())["update_steps"] == 6
