"""The built-in schedules and the checks that run before training."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import numpy as np
import pytest

from octfw.display.errors import UserError
from octfw.plugins.schedulers.constant import ConstantConfig
from octfw.plugins.schedulers.constant import build as build_constant
from octfw.plugins.schedulers.cosine import CosineConfig, warmup_steps
from octfw.plugins.schedulers.cosine import build as build_cosine
from octfw.engine.schedules import effective_lr, plot_schedule, simulate, validate_schedule
from octfw.types import BuildContext, Schedule

BASE_LR = 1e-4
TOTAL = 500


def make_ctx(total: int = TOTAL, base_lr: float = BASE_LR, weight_decay: float = 0.05) -> BuildContext:
    return BuildContext(
        recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
        base_lr=base_lr, weight_decay=weight_decay, total_update_steps=total,
    )


def hf_cosine_with_min_lr(current_step: int, warmup: int, total: int, min_lr_rate: float) -> float:
    """transformers' published lambda for get_cosine_with_min_lr_schedule_with_warmup (num_cycles 0.5)."""
    if current_step < warmup:
        return float(current_step) / float(max(1, warmup))
    progress = float(current_step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0.0, factor)


# --- cosine-no-restart ----------------------------------------------------


def test_cosine_key_points_with_seed_defaults():
    schedule = build_cosine(CosineConfig(), make_ctx())
    assert isinstance(schedule, Schedule)
    warmup = schedule.warmup_steps
    assert warmup == 15  # floor(0.03 * 500)
    assert schedule.lr(0) == pytest.approx(BASE_LR / warmup)
    assert schedule.lr(0) > 0
    assert schedule.lr(warmup - 1) == pytest.approx(BASE_LR, rel=1e-12)
    assert schedule.lr(TOTAL - 1) == pytest.approx(0.1 * BASE_LR, rel=1e-12)
    # flat after the end: no cosine coming back up
    assert [schedule.lr(s) for s in (TOTAL, TOTAL + 7, 3 * TOTAL)] == [schedule.lr(TOTAL - 1)] * 3


def test_cosine_rises_during_warmup_then_never_rises():
    schedule = build_cosine(CosineConfig(warmup=40), make_ctx())
    lr = np.array([schedule.lr(s) for s in range(TOTAL + 50)])
    assert np.all(np.diff(lr[:40]) > 0)
    assert np.all(np.diff(lr[39:]) <= 0)
    assert lr.max() == pytest.approx(BASE_LR)


@pytest.mark.parametrize(
    "warmup, total, ratio",
    [(0.03, 500, 0.1), (10, 60, 0.0), (0.1, 1000, 0.25), (1, 7, 0.1), (0.0, 50, 0.1)],
)
def test_cosine_matches_transformers_formula_one_step_ahead(warmup, total, ratio):
    # octfw's update step s has the LR transformers' LambdaLR holds after s + 1
    # scheduler steps (its step 0 is LR 0); octfw stays flat past the end.
    schedule = build_cosine(CosineConfig(warmup=warmup, min_lr_ratio=ratio), make_ctx(total))
    w = warmup_steps(warmup, total)
    for step in range(total + 20):
        expected = BASE_LR * hf_cosine_with_min_lr(min(step + 1, total), w, total, ratio)
        assert abs(schedule.lr(step) - expected) <= 1e-9 * BASE_LR, step


def test_absolute_min_lr_overrides_ratio():
    schedule = build_cosine(CosineConfig(min_lr=3e-6, min_lr_ratio=0.5), make_ctx())
    assert schedule.lr(TOTAL - 1) == pytest.approx(3e-6, rel=1e-12)


def test_warmup_start_ratio_sets_first_lr():
    schedule = build_cosine(CosineConfig(warmup=10, warmup_start_ratio=0.5), make_ctx())
    assert schedule.lr(0) == pytest.approx(BASE_LR * (0.5 + 0.5 * 1 / 10))
    assert schedule.lr(9) == pytest.approx(BASE_LR)


def test_warmup_fraction_floors_with_at_least_one_step():
    assert warmup_steps(0.03, 10) == 1
    assert warmup_steps(0.29, 100) == 29  # 0.29 * 100 = 28.999... in floating point
    assert warmup_steps(0.0, 100) == 0
    assert warmup_steps(25, 100) == 25


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, 0, True])
def test_cosine_config_refuses_bad_warmup(bad):
    with pytest.raises(ValueError, match="must"):
        CosineConfig(warmup=bad)


def test_cosine_refuses_warmup_longer_than_run_and_floor_above_base():
    with pytest.raises(UserError, match="warmup = 600"):
        build_cosine(CosineConfig(warmup=600), make_ctx())
    with pytest.raises(UserError, match="min_lr"):
        build_cosine(CosineConfig(min_lr=1e-3), make_ctx())


def test_cosine_schedule_passes_validation():
    schedule = build_cosine(CosineConfig(), make_ctx())
    assert validate_schedule(schedule, TOTAL, BASE_LR, schedule.warmup_steps) == []
    assert validate_schedule(schedule, TOTAL, BASE_LR) == []


# --- constant -------------------------------------------------------------


def test_constant_never_rewrites_lr_and_base_lr_stays_in_effect():
    schedule = build_constant(ConstantConfig(), make_ctx())
    assert isinstance(schedule, Schedule)
    assert all(schedule.lr(s) is None for s in range(TOTAL))
    assert all(effective_lr(schedule, s, BASE_LR) == BASE_LR for s in range(TOTAL))
    values = simulate(schedule, TOTAL, BASE_LR)
    assert np.all(values["lr"] == BASE_LR)
    assert validate_schedule(schedule, TOTAL, BASE_LR) == []


# --- EMA momentum and weight decay (shared by both schedulers) ------------


@pytest.mark.parametrize("build, config_cls", [(build_cosine, CosineConfig), (build_constant, ConstantConfig)])
def test_ema_endpoints_linear_vjepa(build, config_cls):
    total = 501  # an odd count puts update step 250 exactly half-way
    schedule = build(config_cls(ema_start=0.998, ema_end=1.0, ema_shape="linear"), make_ctx(total))
    assert schedule.ema_momentum(0) == pytest.approx(0.998)
    assert schedule.ema_momentum(250) == pytest.approx(0.999, rel=1e-12)
    assert schedule.ema_momentum(total - 1) == pytest.approx(1.0, rel=1e-12)
    assert schedule.ema_momentum(total + 10) == pytest.approx(1.0, rel=1e-12)


def test_ema_cosine_and_constant_shapes():
    cos = build_cosine(CosineConfig(ema_start=0.996, ema_end=1.0, ema_shape="cosine"), make_ctx())
    ema = np.array([cos.ema_momentum(s) for s in range(TOTAL)])
    assert ema[0] == pytest.approx(0.996) and ema[-1] == pytest.approx(1.0)
    assert np.all(np.diff(ema) >= 0)
    assert ema[TOTAL // 10] - ema[0] < 0.1 * (1.0 - 0.996)  # slow start, unlike linear
    const = build_constant(ConstantConfig(ema_shape="constant"), make_ctx())
    assert {const.ema_momentum(s) for s in range(TOTAL)} == {0.996}


def test_ema_end_below_start_is_refused_by_config():
    with pytest.raises(ValueError, match="ema_start"):
        ConstantConfig(ema_start=0.999, ema_end=0.99)


def test_weight_decay_constant_by_default_and_cosine_to_end():
    flat = build_constant(ConstantConfig(), make_ctx(weight_decay=0.05))
    assert {flat.weight_decay(s) for s in range(TOTAL)} == {0.05}
    ramp = build_cosine(CosineConfig(weight_decay_end=0.4), make_ctx(weight_decay=0.04))
    assert ramp.weight_decay(0) == pytest.approx(0.04)
    assert ramp.weight_decay(TOTAL - 1) == pytest.approx(0.4)


def test_shared_options_are_one_definition():
    names = [f.name for f in attrs.fields(CosineConfig)]
    for field in ("ema_start", "ema_end", "ema_shape", "weight_decay_end"):
        assert field in names and field in [f.name for f in attrs.fields(ConstantConfig)]
    assert type(build_cosine(CosineConfig(), make_ctx())).ema_momentum is type(
        build_constant(ConstantConfig(), make_ctx())
    ).ema_momentum


# --- validation -----------------------------------------------------------


@attrs.define
class WarmRestarts:
    """Imitates torch's CosineAnnealingWarmRestarts stepped per update: back to the peak every period."""

    base_lr: float = BASE_LR
    min_lr: float = 1e-5
    period: int = 200

    def lr(self, step):
        t = (step % self.period) / self.period
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * t))

    def weight_decay(self, step):
        return None

    def ema_momentum(self, step):
        return None


def test_warm_restarts_are_refused_naming_the_step():
    problems = validate_schedule(WarmRestarts(), TOTAL, BASE_LR)
    assert len(problems) == 1
    assert "lr rises after warmup at update step 200" in problems[0]
    assert "restarts is refused" in problems[0]
    assert "-> 1.0e-04" in problems[0]


@attrs.define
class LinearToZero:
    """Decays to 0 at ``zero_at`` and stays there: the seeds' LR = 0."""

    zero_at: int = 120

    def lr(self, step):
        return max(0.0, BASE_LR * (1 - step / self.zero_at))

    def weight_decay(self, step):
        return 0.05

    def ema_momentum(self, step):
        return 0.996


def test_lr_reaching_zero_early_is_refused():
    problems = validate_schedule(LinearToZero(), TOTAL, BASE_LR)
    assert problems == ["lr reaches 0.0 at update step 120 of 500"]


def test_lr_zero_only_at_last_step_is_allowed():
    assert validate_schedule(LinearToZero(zero_at=TOTAL - 1), TOTAL, BASE_LR) == []


def test_constant_with_zero_base_lr_is_refused_at_step_zero():
    schedule = build_constant(ConstantConfig(), make_ctx(base_lr=0.0))
    assert validate_schedule(schedule, TOTAL, 0.0) == ["lr reaches 0.0 at update step 0 of 500"]


@attrs.define
class Broken:
    def lr(self, step):
        return float("nan") if step == 7 else BASE_LR

    def weight_decay(self, step):
        return 0.05

    def ema_momentum(self, step):
        return 1.2 if step >= 3 else 0.999 - 0.001 * step


def test_nonfinite_and_bad_ema_are_refused_naming_steps():
    problems = validate_schedule(Broken(), 20, BASE_LR)
    assert "lr is nan at update step 7 of 20" in problems
    assert "ema_momentum is 1.2 at update step 3 of 20, outside [0, 1]" in problems
    assert any(p.startswith("ema_momentum decreases at update step 1:") for p in problems)


def test_warmup_hint_bounds_the_rising_part():
    schedule = build_cosine(CosineConfig(warmup=50), make_ctx())
    problems = validate_schedule(schedule, TOTAL, BASE_LR, warmup_steps_hint=10)
    assert problems and "update step 10:" in problems[0]


# --- simulation and plot --------------------------------------------------


def test_simulate_covers_every_update_step():
    schedule = build_cosine(CosineConfig(weight_decay_end=0.1), make_ctx(total=60))
    values = simulate(schedule, 60, BASE_LR)
    assert set(values) == {"update_step", "lr", "weight_decay", "ema_momentum"}
    assert all(len(v) == 60 for v in values.values())
    assert values["lr"][5] == schedule.lr(5)
    assert values["weight_decay"][-1] == pytest.approx(0.1)


def test_simulate_marks_unscheduled_values_nan():
    values = simulate(WarmRestarts(), 10, BASE_LR)
    assert np.isnan(values["ema_momentum"]).all()


def test_plot_writes_a_png(tmp_path):
    schedule = build_cosine(CosineConfig(weight_decay_end=0.1), make_ctx(total=200))
    path = plot_schedule(simulate(schedule, 200, BASE_LR), tmp_path / "plots" / "schedule.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_vjepa_options_refuse_a_warmup_start_above_base_lr_and_a_horizon_shorter_than_the_run():
    with pytest.raises(UserError, match="warmup_start_lr = 0.001 is above"):
        build_cosine(CosineConfig(warmup=10, warmup_start_lr=1e-3), make_ctx())
    with pytest.raises(ValueError, match=r"must be in \[1.0, inf\], got 0.8"):
        CosineConfig(horizon_scale=0.8)
    with pytest.raises(ValueError, match="must be one of 'cosine', 'linear'"):
        CosineConfig(decay="step")


def test_horizon_scale_counts_as_vjepa_the_run_stops_short_of_the_end_values():
    # 100 update steps over a horizon of 125: the EMA is 0.998 + 99 x 0.002 / 125 at the last step.
    schedule = build_cosine(CosineConfig(warmup=10, warmup_start_lr=2e-5, min_lr=1e-6, horizon_scale=1.25,
                                         ema_start=0.998, ema_end=1.0, weight_decay_end=0.4),
                            make_ctx(total=100, weight_decay=0.04))
    assert schedule.lr(0) == 2e-5 + 1 / 10 * (BASE_LR - 2e-5)
    assert schedule.ema_momentum(99) == 0.998 + 99 * (1.0 - 0.998) / 125.0
    assert schedule.weight_decay(99) < 0.4 and schedule.lr(99) > 1e-6
    plain = build_cosine(CosineConfig(warmup=10, min_lr=1e-6, ema_start=0.998, weight_decay_end=0.4),
                         make_ctx(total=100, weight_decay=0.04))
    assert plain.ema_momentum(99) == 1.0 and plain.weight_decay(99) == pytest.approx(0.4)
    assert plain.lr(99) == pytest.approx(1e-6)


def test_linear_decay_is_vjepa2s_cooldown_straight_down_to_min_lr():
    schedule = build_cosine(CosineConfig(warmup=0.0, min_lr=1e-6, decay="linear"), make_ctx(total=100))
    lrs = [schedule.lr(step) for step in range(100)]
    assert lrs[0] == BASE_LR + 0.01 * (1e-6 - BASE_LR)
    assert np.allclose(np.diff(lrs), (1e-6 - BASE_LR) / 100, rtol=1e-6, atol=0)
    assert lrs[-1] == pytest.approx(1e-6)
