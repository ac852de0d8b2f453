"""`octfw plot` (a run's metrics) and `octfw lr` (a recipe's schedule, with its verdict)."""

from __future__ import annotations

import importlib
import math
import sys

import pytest

from octfw.cli import main
from octfw.plots import read_metrics
from octfw.plugins.loggers.jsonl import JsonlLogger

from conftest import make_dist

MIN_PNG_BYTES = 10_000  # an empty figure is a few kB; four drawn panels are several times that


def write_log(run_dir, steps=range(1, 13)):
    """A metrics log as the jsonl logger writes it: two domains, one skipped step, a resume."""
    logger = JsonlLogger()
    logger.start(len(steps), run_dir, {})
    for step in steps:
        logger.log(step, {"loss": 1.0 / step if step != 5 else math.nan, "lr": 1e-4 * (1 - step / 20),
                          "grad_norm": 0.5 + 0.01 * step, "skipped_updates": float(step >= 5),
                          "loss/heidelberg": 1.1 / step, "loss/topcon": 0.0 if step == 3 else 0.9 / step})
    logger.finish({})
    # A resumed run logs steps 11 and 12 again; its values are the ones kept.
    logger.start(len(steps), run_dir, {})
    for step in (11, 12):
        logger.log(step, {"loss": 0.5, "lr": 1e-5, "grad_norm": 0.4, "skipped_updates": 1.0})
    logger.finish({})


def test_read_metrics_keeps_the_last_line_of_each_step_and_nulls_as_nan(tmp_path):
    write_log(tmp_path)
    series = read_metrics(tmp_path / "metrics.jsonl")
    steps, loss = series["loss"]
    assert steps == list(range(1, 13))
    assert math.isnan(loss[4]) and loss[10:] == [0.5, 0.5]
    assert series["loss/heidelberg"][0] == list(range(1, 13))
    assert "time" not in series and "step" not in series


def test_plot_draws_a_png_of_the_run(tmp_path, capsys):
    write_log(tmp_path)
    png = tmp_path / "out" / "run.png"
    assert main(["plot", str(tmp_path), "--png", str(png)]) == 0
    assert png.stat().st_size > MIN_PNG_BYTES
    assert str(png) in capsys.readouterr().out
    # Without --png the plot goes into the run folder.
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "run.png").stat().st_size > MIN_PNG_BYTES


def test_plot_of_a_missing_or_empty_log_is_a_clear_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl: no metrics log here" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics log is empty" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"loss": 2.0}\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl:2: not a metrics line" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_lr_draws_the_schedule_and_accepts_cosine(tiny_recipe, tmp_path, capsys):
    png = tmp_path / "lr.png"
    assert main(["lr", str(tiny_recipe), "--set", "run.max_steps=40", "--set", "scheduler.warmup=4",
                 "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "40 update steps" in out and "peak 0.001 at update step 3" in out
    assert "verdict   ok" in out
    assert png.stat().st_size > MIN_PNG_BYTES


def test_lr_derives_the_total_from_dataset_size_epochs_and_devices(tiny_recipe, capsys):
    # 8 volumes, 2 per device: 4 update steps per epoch on one device, 2 on two.
    sets = ["--set", "run.max_steps=100", "--set", "run.epochs=3"]
    assert main(["lr", str(tiny_recipe), *sets]) == 0
    assert "12 update steps, 4 per epoch on 1 device" in capsys.readouterr().out
    assert main(["lr", str(tiny_recipe), *sets, "--devices", "2"]) == 0
    assert "6 update steps, 2 per epoch on 2 devices" in capsys.readouterr().out


RESTART_PLUGIN = '''
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class RestartConfig:
    period: int = 4

class Restarts:
    """A sawtooth: the LR climbs to base_lr every `period` steps, then drops back (warm restarts)."""
    def __init__(self, period, base_lr):
        self.period, self.base_lr = period, base_lr
    def lr(self, update_step):
        return self.base_lr * (1 + update_step % self.period) / self.period
    def weight_decay(self, update_step):
        return None
    def ema_momentum(self, update_step):
        return None

@hookimpl
def octfw_register_schedulers(register):
    register("warm-restarts", RestartConfig, lambda c, ctx: Restarts(c.period, ctx.base_lr), "restarts")
'''


@pytest.fixture
def restarts(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("restart-site")
    make_dist(root, "octfw-restarts", "plug_restarts", RESTART_PLUGIN)
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("plug_restarts", None)
    yield importlib.import_module("plug_restarts")
    sys.modules.pop("plug_restarts", None)


def test_lr_refuses_warm_restarts_with_the_step_and_values_after_drawing_them(
        restarts, write_recipe, tiny_recipe, tmp_path, capsys):
    recipe = write_recipe(tiny_recipe.read_text().replace('name = "cosine-no-restart"\nwarmup = 1',
                                                          'name = "warm-restarts"'), "restarts.toml")
    png = tmp_path / "lr.png"
    assert main(["lr", str(recipe), "--set", "run.max_steps=12", "--png", str(png)]) == 2
    captured = capsys.readouterr()
    assert "rises after warmup at update step 5: 2.5e-04 -> 5.0e-04" in captured.err
    assert "warm-restarts" in captured.err and "refused" in captured.err
    assert png.stat().st_size > MIN_PNG_BYTES  # drawn first, to see what was refused
