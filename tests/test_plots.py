"""`octfw plot` (a run's metrics) and `octfw lr` (a recipe's schedule, with its verdict)."""

from __future__ import annotations

import importlib
import math
import sys

import pytest

from octfw.cli.main import main
from octfw.display.errors import UserError
from octfw.plugins.loggers.jsonl import JsonlLogger
from octfw.display.plots import collapse_thresholds, plan_panels, read_metrics, step_axis, step_label

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


def test_update_steps_get_short_tick_labels_that_do_not_run_into_each_other():
    assert [step_label(v) for v in (0, 2500, 9999, 10_000, 12_500, 24_000, 1_200_000)] == \
        ["0", "2,500", "9,999", "10k", "12.5k", "24k", "1.2M"]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A 4-inch panel of steps 3,000-24,000: matplotlib's default labels ("25000" every 2,500) overlapped.
    fig = Figure(figsize=(4.0, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set_ylabel("balanced_accuracy")
    ax.plot([3000, 24_000], [0.8, 0.9])
    step_axis(ax.xaxis)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    boxes = [label.get_window_extent(fig.canvas.get_renderer()) for label in ax.get_xticklabels()
             if label.get_text() and low <= label.get_position()[0] <= high]
    boxes.sort(key=lambda box: box.x0)
    assert len(boxes) >= 3
    assert all(left.x1 < right.x0 for left, right in zip(boxes, boxes[1:]))


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


def write_collapsing_log(run_dir, steps=range(1, 21)):
    """A run whose features collapse after step 5, with two evaluators every 10 steps
    (their per-domain values and intervals too, as the engine logs them)."""
    logger = JsonlLogger()
    logger.start(len(steps), run_dir, {})
    for step in steps:
        healthy = step <= 5
        logger.log(step, {"loss": 1.0 / step, "lr": 1e-3, "grad_norm": 0.5, "skipped_updates": 0.0,
                          "metric/target_std": 0.03 if healthy else 0.004,
                          "metric/effective_rank": 4.2 if healthy else 1.05, "metric/effective_rank_max": 63.0,
                          "metric/rankme": 30.0 if healthy else 4.0, "metric/rankme_max": 64.0,
                          "metric/position_share": 0.7 if healthy else 0.98, "metric/pred_std": 0.03})
        if step % 10 == 0:
            logger.log(step, {"eval/linear-probe/accuracy": 0.6, "eval/linear-probe/auroc": 0.7,
                              "eval/linear-probe/auroc_ci_low": 0.6, "eval/linear-probe/accuracy/zeiss": 0.5,
                              "eval/knn/balanced_accuracy": 0.55})
    logger.finish({})


def test_plot_puts_collapse_signals_and_evaluations_next_to_the_loss(tmp_path):
    write_collapsing_log(tmp_path)
    (tmp_path / "recipe.toml").write_text(
        'guard = [{ name = "nan-skip" }, { name = "collapse", min_std = 0.01, min_effective_rank = 2.0, '
        'min_rankme = 8.0, max_position_share = 0.95 }]\n')
    series = read_metrics(tmp_path / "metrics.jsonl")
    panels = plan_panels(series, collapse_thresholds(tmp_path))
    # No update was skipped: a panel of zeros would say nothing (the title says it instead).
    assert [p.title.split(" (")[0] for p in panels] == [
        "loss", "target std", "effective rank and its maximum", "RankMe and its maximum",
        "position share of the token variance", "evaluation", "learning rate", "gradient norm"]
    loss, std, rank, rankme, position, evaluation = panels[:6]
    assert rankme.keys == ("metric/rankme", "metric/rankme_max") and rankme.thresholds == (8.0,)
    assert position.keys == ("metric/position_share",) and position.thresholds == (0.95,)
    assert std.keys == ("metric/target_std",) and std.thresholds == (0.01,)
    # The rank beside its ceiling for the logged shapes: 4.2 of 63 directions, not of 6.
    assert rank.keys == ("metric/effective_rank", "metric/effective_rank_max") and rank.thresholds == (2.0,)
    # Overall scores by evaluator, not per-domain values or interval ends.
    assert evaluation.keys == ("eval/knn/balanced_accuracy", "eval/linear-probe/accuracy",
                               "eval/linear-probe/auroc")
    assert series["eval/linear-probe/accuracy"][0] == [10, 20]
    png = tmp_path / "run.png"
    assert main(["plot", str(tmp_path), "--png", str(png)]) == 0
    assert png.stat().st_size > MIN_PNG_BYTES


def test_plot_of_a_run_without_collapse_metrics_or_evaluations_keeps_four_panels(tmp_path):
    write_log(tmp_path)
    panels = plan_panels(read_metrics(tmp_path / "metrics.jsonl"), collapse_thresholds(tmp_path))
    assert [p.title for p in panels] == ["loss", "learning rate", "gradient norm (before clipping)",
                                         "skipped updates (total)"]
    assert panels[0].keys == ("loss", "loss/heidelberg", "loss/topcon")


def test_collapse_thresholds_come_from_the_collapse_guard_only(tmp_path):
    assert collapse_thresholds(tmp_path) == {}  # no recipe.toml: nothing to annotate
    (tmp_path / "recipe.toml").write_text('guard = [{ name = "loss-spike", min_std = 5.0 }, '
                                          '{ name = "collapse", min_effective_rank = 3.0 }]\n')
    assert collapse_thresholds(tmp_path) == {"metric/effective_rank": 3.0}  # min_std left out: unwatched
    (tmp_path / "recipe.toml").write_text("guard = [\n")
    with pytest.raises(UserError, match="recipe.toml: cannot be read"):
        collapse_thresholds(tmp_path)


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
    tiny_recipe.write_text(tiny_recipe.read_text().replace("max_steps = 4", "epochs = 3"))
    assert main(["lr", str(tiny_recipe)]) == 0
    assert "12 update steps, 4 per epoch on 1 device" in capsys.readouterr().out
    assert main(["lr", str(tiny_recipe), "--devices", "2"]) == 0
    assert "6 update steps, 2 per epoch on 2 devices" in capsys.readouterr().out


def test_lr_previews_a_length_in_steps_without_the_data(write_recipe, tiny_recipe, tmp_path, capsys):
    """run.max_steps wins over run.epochs for a preview, and --steps over both: the dataset
    (here a manifest that does not exist) is never read."""
    recipe = write_recipe(tiny_recipe.read_text().replace("max_steps = 4", "epochs = 150").replace(
        'name = "synthetic-oct"\nn_volumes = 8', f'name = "dicom"\npath = "{tmp_path}/absent/manifest.csv"'),
        "no_data.toml")
    assert main(["lr", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "manifest not found" in err and "--steps N" in err  # epochs alone: the data is needed
    png = tmp_path / "lr.png"
    assert main(["lr", str(recipe), "--set", "run.max_steps=1000", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "1000 update steps (run.max_steps; the run stops sooner if run.epochs = 150 ends first)" in out
    assert png.stat().st_size > MIN_PNG_BYTES
    assert main(["lr", str(recipe), "--set", "run.max_steps=1000", "--steps", "40"]) == 0
    assert "40 update steps (--steps) on 1 device" in capsys.readouterr().out
    assert main(["lr", str(recipe), "--steps", "0"]) == 2
    assert "--steps 0: must be at least 1" in capsys.readouterr().err


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


def test_the_plot_draws_the_lr_schedule_at_every_step_through_the_logged_values(tiny_recipe, capsys):
    """The log samples the LR at log steps; the plot rebuilds the run's schedule for every step,
    and it passes through every logged value (same step numbering as metrics.jsonl)."""
    from octfw.cli.commands.plot import _schedule

    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=6", "--set", "engine.log_every_steps=2",
                 "--set", "scheduler.warmup=3"]) == 0
    [run_dir] = (tiny_recipe.parent / "runs" / tiny_recipe.stem).iterdir()
    steps, lr = _schedule(run_dir)
    assert steps == [1, 2, 3, 4, 5, 6]
    logged_steps, logged_lr = read_metrics(run_dir / "metrics.jsonl")["lr"]
    assert logged_steps == [2, 4, 6]
    assert [lr[s - 1] for s in logged_steps] == pytest.approx(logged_lr, rel=1e-6)
    assert lr[0] < lr[1] < lr[2]  # the warmup, between log steps
    assert main(["plot", str(run_dir)]) == 0 and (run_dir / "run.png").stat().st_size > MIN_PNG_BYTES
