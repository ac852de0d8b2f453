"""Collapse watch: the effective-rank metric and the `collapse` guard."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from octfw.cli.main import main
from octfw.display.errors import RecipeError
from octfw.plugins.guards.collapse import CollapseConfig, CollapseGuard, build
from octfw.models.health import RANK_TOKENS, effective_rank, embedding_std
from octfw.recipe import load_recipe
from octfw.types import StopTraining

from conftest import TINY_RECIPE
from test_vjepa3d import RecordOps, make_batch, make_model

# --- the metrics -------------------------------------------------------------


def OldSignals(**options) -> CollapseConfig:
    """The guard watching only the std and the participation ratio (these tests' metrics)."""
    return CollapseConfig(**{"min_rankme": None, "max_position_share": None, **options})


def test_a_collapsed_embedding_has_std_zero_and_effective_rank_one():
    same = torch.randn(64).expand(2, 100, 64)  # every token the same vector
    assert embedding_std(same) == 0
    assert effective_rank(same) == pytest.approx(1.0)


def test_embeddings_on_one_direction_have_effective_rank_one():
    direction = torch.randn(64)
    scales = torch.rand(2, 100, 1) + 0.5
    assert effective_rank(scales * direction) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("k", [2, 5, 12])
def test_effective_rank_counts_the_directions_used(k):
    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(64, k)).Q.T  # k orthonormal directions in 64-D
    tokens = torch.randn(1, 2000, k) @ basis
    assert k * 0.8 < effective_rank(tokens) <= k + 1e-3


def test_healthy_embeddings_have_a_high_effective_rank():
    torch.manual_seed(0)
    assert effective_rank(torch.randn(2, 1000, 64)) > 48


def test_effective_rank_is_float32_under_bf16_autocast():
    torch.manual_seed(0)
    tokens = torch.randn(2, 300, 32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rank = effective_rank(tokens)
    assert rank.dtype == torch.float32 and rank.dim() == 0
    assert rank == pytest.approx(float(effective_rank(tokens.float())), rel=1e-4)


def test_effective_rank_cost_does_not_grow_with_the_number_of_tokens():
    def flops(n_tokens: int) -> int:
        with FlopCounterMode(display=False) as counter:
            effective_rank(torch.randn(1, n_tokens, 64))
        return counter.get_total_flops()

    assert flops(RANK_TOKENS * 4) == flops(RANK_TOKENS * 40) > 0


def test_effective_rank_never_syncs_or_decomposes():
    with RecordOps() as recorder:
        effective_rank(torch.randn(2, 700, 48))
    forbidden = {"aten._local_scalar_dense", "aten.nonzero", "aten.item"}
    assert not recorder.ops & forbidden
    # Decompositions check their convergence on the host on CUDA.
    assert not [op for op in recorder.ops if "svd" in op or "eig" in op]


def test_model_reports_effective_rank_with_target_std():
    torch.manual_seed(0)
    model = make_model()
    out = model(make_batch(model))
    assert {"target_std", "pred_std", "effective_rank"} <= set(out.metrics)
    rank = out.metrics["effective_rank"]
    assert rank.dim() == 0 and rank.dtype == torch.float32 and 1.0 <= float(rank)


# --- the guard ----------------------------------------------------------------


def feed(guard: CollapseGuard, stds, ranks=None, start: int = 10, every: int = 10) -> None:
    ranks = ranks or [50.0] * len(stds)
    for i, (std, rank) in enumerate(zip(stds, ranks)):
        guard.at_log_step(start + i * every, {"metric/target_std": std, "metric/effective_rank": rank})


def test_guard_is_quiet_on_healthy_metrics(capsys):
    guard = CollapseGuard(OldSignals(min_std=0.01, min_effective_rank=4.0, action="stop"))
    feed(guard, [0.05, 0.04, 0.011, 0.03] * 5, [40.0, 30.0, 4.5, 20.0] * 5)
    assert capsys.readouterr().err == ""


def test_guard_warns_once_naming_metric_value_threshold_and_step(capsys):
    guard = CollapseGuard(OldSignals(min_std=0.01, patience=3))
    feed(guard, [0.05, 0.002, 0.0015, 0.001, 0.001, 0.0009])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1  # one line per episode, not one per log step
    line = lines[0]
    assert "metric/target_std" in line and "0.001" in line and "min_std = 0.01" in line
    assert "update step 40" in line  # the third low value in a row


def test_guard_counts_log_steps_in_a_row(capsys):
    guard = CollapseGuard(OldSignals(min_std=0.01, patience=3, action="stop"))
    feed(guard, [0.001, 0.001, 0.05, 0.001, 0.001, 0.05])  # never three in a row
    assert capsys.readouterr().err == ""


def test_guard_warns_again_after_recovering_and_collapsing_again(capsys):
    guard = CollapseGuard(OldSignals(min_std=0.01, patience=2))
    feed(guard, [0.001, 0.001, 0.05, 0.001, 0.001])
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


def test_guard_stops_on_a_low_effective_rank():
    guard = CollapseGuard(OldSignals(min_std=None, min_effective_rank=3.0, patience=2, action="stop"))
    with pytest.raises(StopTraining, match=r"metric/effective_rank = 1\.2 < min_effective_rank = 3 .*step 20"):
        feed(guard, [0.0, 0.0], [1.2, 1.2])


def test_a_threshold_left_out_is_not_watched(capsys, caplog):
    def warned() -> bool:  # printed to stderr or logged
        return bool(capsys.readouterr().err) or any(r.levelno >= logging.WARNING for r in caplog.records)

    # min_std left out: a collapsed target_std, or none reported, neither stops nor warns.
    guard = CollapseGuard(OldSignals(min_std=None, min_effective_rank=3.0, patience=1, action="stop"))
    feed(guard, [0.0, 0.0], [50.0, 50.0])
    guard.at_log_step(30, {"metric/effective_rank": 50.0})
    assert guard.state_dict() == {"below": {"metric/effective_rank": 0}}
    assert not warned()
    with pytest.raises(StopTraining, match="metric/effective_rank"):  # the threshold kept still acts
        feed(guard, [0.0], [1.0], start=40)
    # Both left out: the guard watches nothing, whatever the metrics say.
    unwatched = CollapseGuard(OldSignals(min_std=None, min_effective_rank=None, patience=1, action="stop"))
    feed(unwatched, [0.0, 0.0], [1.0, 1.0])
    unwatched.at_log_step(30, {"loss": 1.0})
    assert unwatched.state_dict() == {"below": {}}
    assert not warned()


def test_a_nan_metric_neither_counts_nor_breaks_the_streak():
    guard = CollapseGuard(OldSignals(min_std=0.01, patience=3, action="stop"))
    feed(guard, [0.001, math.nan, 0.001])
    with pytest.raises(StopTraining):
        feed(guard, [0.001], start=40)


def test_guard_warns_once_when_the_model_reports_no_such_metric(capsys):
    guard = CollapseGuard(OldSignals(min_std=0.01, min_effective_rank=None, action="stop"))
    for step in (1, 2, 3, 4):
        guard.at_log_step(step, {"loss": 1.0})
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no metric/target_std" in err[0]


def test_guard_does_no_device_work_and_its_streak_survives_a_resume():
    guard = CollapseGuard(OldSignals(min_std=0.01, patience=3, action="stop"))
    assert guard.before_step(None) is None
    feed(guard, [0.001, 0.001])
    resumed = CollapseGuard(OldSignals(min_std=0.01, patience=3, action="stop"))
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    with pytest.raises(StopTraining):
        feed(resumed, [0.001], start=30)


def test_guard_config_is_validated_in_recipes(write_recipe, registry):
    path = write_recipe(TINY_RECIPE + '\n[[guard]]\nname = "collapse"\naction = "explode"\npatience = 0\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(path, (), registry)
    text = str(info.value)
    assert "guard[0].action" in text and "guard[0].patience" in text


def test_guard_is_registered_and_its_module_imports_without_torch(registry):
    component = registry.get("guard", "collapse")
    assert component.config is CollapseConfig
    assert isinstance(build(CollapseConfig(), None), CollapseGuard)
    code = "import sys, octfw.plugins.guards.collapse; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- in a run -------------------------------------------------------------------


def run_tiny(write_recipe, tmp_path, guard: str, sets: tuple[str, ...] = ()) -> tuple[int, dict]:
    path = write_recipe(TINY_RECIPE + '\n[[guard]]\nname = "nan-skip"\n\n[[guard]]\nname = "collapse"\n' + guard)
    overrides = [arg for value in sets for arg in ("--set", value)]
    code = main(["run", str(path), "--set", f"run.output_dir={tmp_path / 'runs'}", *overrides])
    run_dir = next((tmp_path / "runs" / "recipe").iterdir())
    return code, json.loads((run_dir / "summary.json").read_text())


def logged(tmp_path, key: str) -> list[float]:
    """``key`` at every log step of the run in ``tmp_path``, from its metrics.jsonl."""
    run_dir = next((tmp_path / "runs" / "recipe").iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


def test_tiny_run_with_the_guard_warning_completes(write_recipe, tmp_path, capsys):
    # A threshold no embedding reaches: the guard must warn, and the run go on.
    code, summary = run_tiny(write_recipe, tmp_path, 'min_std = 0.9\npatience = 2\naction = "warn"\n')
    assert code == 0
    assert summary["update_steps"] == summary["total_update_steps"] == 4 and summary["stopped"] is None
    err = capsys.readouterr().err
    assert "collapse: metric/target_std" in err and "min_std = 0.9" in err and "update step 2" in err


def test_tiny_run_with_the_guard_stopping_ends_cleanly(write_recipe, tmp_path):
    code, summary = run_tiny(write_recipe, tmp_path, 'min_effective_rank = 1000.0\npatience = 1\naction = "stop"\n')
    assert code == 1
    assert summary["update_steps"] == 1 and "metric/effective_rank" in summary["stopped"]


# --- a collapse induced in a real run ------------------------------------------
#
# The tiny recipe with 32 patch tokens per volume (8 x 64 x 64 in 4 x 16 x 16
# patches, so a healthy encoder's effective rank, about 4, is well clear of a
# collapsed one's 1) and a high learning rate. With the EMA's lag (0.996 -> 1)
# the target encoder barely moves and gives the predictor a fixed target;
# with momentum 0 the target encoder is the context encoder itself after every
# update, the target moves with the network that predicts it, and the pair
# falls into the trivial solution, every token the same vector, within a few
# updates. Nothing is mocked: the real model, engine, metrics and guard.
FAST_LR = ("transform.image_size=[8, 64, 64]", "engine.base_lr=1e-2", "run.max_steps=20")
NO_EMA_LAG = ("scheduler.ema_start=0.0", "scheduler.ema_end=0.0")


def test_a_run_without_ema_lag_collapses_and_the_guard_says_so(write_recipe, tmp_path, capsys):
    code, summary = run_tiny(write_recipe, tmp_path, 'action = "warn"\n', FAST_LR + NO_EMA_LAG)
    assert code == 0 and summary["update_steps"] == 20  # warn: the run goes on
    ranks, rankme = logged(tmp_path, "metric/effective_rank"), logged(tmp_path, "metric/rankme")
    shares, stds = logged(tmp_path, "metric/position_share"), logged(tmp_path, "metric/target_std")
    assert ranks[0] > 2.0 and max(ranks[-10:]) < 1.5  # several directions, then one
    assert rankme[0] > 15 and max(rankme[-10:]) < 8  # RankMe sees it too, out of 64
    assert shares[0] < 0.9 and min(shares[-10:]) > 0.9  # what is left is the position
    # The collapse is into position: the normalised tokens stay as spread as before, so the
    # std alone would never have seen it.
    assert min(stds[-10:]) > 0.5 * stds[0]
    err = capsys.readouterr().err
    assert "collapse: metric/rankme" in err and "min_rankme = 8" in err
    assert "collapse: metric/position_share" in err and "carry little but their position" in err


def test_a_collapse_stops_a_run_that_asks_to_stop(write_recipe, tmp_path):
    code, summary = run_tiny(write_recipe, tmp_path, 'action = "stop"\n', FAST_LR + NO_EMA_LAG)
    assert code == 1 and summary["update_steps"] < 20
    assert "collapse: metric/" in summary["stopped"]
    assert logged(tmp_path, "metric/effective_rank")[-1] < 1.5


def test_the_same_run_with_the_ema_lag_stays_healthy_and_the_guard_quiet(write_recipe, tmp_path, capsys):
    # The control: only the EMA differs from the collapsing run.
    code, summary = run_tiny(write_recipe, tmp_path, 'action = "stop"\n', FAST_LR)
    assert code == 0 and summary["update_steps"] == 20 and summary["stopped"] is None
    assert min(logged(tmp_path, "metric/effective_rank")) > 1.8
    assert min(logged(tmp_path, "metric/rankme")) > 15
    assert max(logged(tmp_path, "metric/position_share")) < 0.93
    assert min(logged(tmp_path, "metric/target_std")) > 0.015
    assert "collapse:" not in capsys.readouterr().err


@pytest.mark.parametrize("tokens, width, expected", [(64, 96, 63), (2, 192, 1), (4096, 32, 32), (1500, 2048, 511)])
def test_the_effective_ranks_ceiling_is_what_the_shapes_allow_and_is_logged(tokens, width, expected):
    """At most the tokens kept (at most RANK_TOKENS, 512), less one for centring, or the width."""
    from octfw.models.health import effective_rank, effective_rank_ceiling, health_metrics

    torch.manual_seed(0)
    features = torch.randn(1, tokens, width)
    assert effective_rank_ceiling(features) == expected
    metrics = health_metrics(features, features)
    assert float(metrics["effective_rank_max"]) == expected
    assert float(effective_rank(features)) <= expected + 1e-3  # a participation ratio never exceeds it


def test_position_share_is_one_for_tokens_that_are_only_their_position_and_low_for_content():
    from octfw.models.health import position_share

    torch.manual_seed(0)
    position = torch.randn(1, 64, 32)
    assert float(position_share(position.expand(8, 64, 32))) == pytest.approx(1.0)
    content = torch.randn(8, 64, 32)  # nothing shared by the tokens at one position
    assert float(position_share(content)) < 0.05
    mixed = position.expand(8, 64, 32) + content  # half the variance each
    assert float(position_share(mixed)) == pytest.approx(0.5, abs=0.08)
    # Positions given per token (MAE's visible tokens) give the same answer as the full grid.
    order = torch.stack([torch.randperm(64) for _ in range(8)])
    shuffled = torch.gather(mixed, 1, order[..., None].expand(-1, -1, 32))
    assert float(position_share(shuffled, order, 64)) == pytest.approx(float(position_share(mixed)), abs=1e-5)
    assert math.isnan(float(position_share(mixed[:1])))  # one sample: no position holds two tokens


def test_rankme_counts_the_directions_with_entropy_and_reaches_the_width():
    import numpy as np

    from octfw.models.health import rank_gram, rankme, spectrum_metrics

    rng = np.random.default_rng(0)
    gram = lambda x: rank_gram(torch.from_numpy(x).float()).numpy()  # noqa: E731 (as a model hands it)
    assert rankme(gram(np.outer(rng.normal(size=512), rng.normal(size=64)))) == pytest.approx(1.0, abs=0.01)
    spread = rng.normal(size=(512, 64))
    assert 55 < rankme(gram(spread)) <= 64
    # The entropy of the singular values, as the paper defines it.
    singular = np.linalg.svd(spread, compute_uv=False)
    p = singular / singular.sum() + 1e-7
    assert rankme(gram(spread)) == pytest.approx(float(np.exp(-(p * np.log(p)).sum())), rel=1e-4)
    # A spectrum of one large and many small directions: the participation ratio calls it about
    # one direction, RankMe still counts the rest.
    skewed = spread * np.r_[20.0, np.ones(63)]
    assert rankme(gram(skewed)) > 30
    assert spectrum_metrics(gram(spread)) == {"rankme": rankme(gram(spread)), "rankme_max": 64.0}


def test_the_guard_acts_on_rankme_and_on_the_position_share():
    from octfw.plugins.guards.collapse import CollapseConfig, CollapseGuard

    guard = CollapseGuard(CollapseConfig(min_std=None, min_effective_rank=None, patience=2, action="stop"))
    healthy = {"metric/rankme": 30.0, "metric/position_share": 0.7}
    guard.at_log_step(1, healthy)
    guard.at_log_step(2, {**healthy, "metric/position_share": 0.97})
    with pytest.raises(StopTraining, match=r"metric/position_share = 0.98 > max_position_share = 0.95"):
        guard.at_log_step(3, {**healthy, "metric/position_share": 0.98})
    guard = CollapseGuard(CollapseConfig(min_std=None, min_effective_rank=None, patience=1, action="stop"))
    with pytest.raises(StopTraining, match=r"metric/rankme = 4 < min_rankme = 8"):
        guard.at_log_step(1, {**healthy, "metric/rankme": 4.0})


def test_a_floor_of_0_or_a_ceiling_of_1_turns_a_signal_off(capsys):
    """A recipe cannot write None: 0 (a floor) or 1 (a ceiling) is how a signal is not watched."""
    guard = CollapseGuard(CollapseConfig(min_std=0, min_effective_rank=0, min_rankme=0, max_position_share=1.0,
                                         patience=1, action="stop"))
    assert guard.watches == {}
    guard.at_log_step(1, {"metric/rankme": 0.5, "metric/position_share": 1.0, "metric/target_std": 0.0})
    assert "collapse" not in capsys.readouterr().err  # nothing watched, nothing reported missing
