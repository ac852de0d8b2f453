"""octfw's schedules against V-JEPA's, step by step (tests/fixtures/reference/schedules.json).

The fixture holds the LR, weight decay and EMA momentum that facebookresearch/vjepa2's
own code (``init_opt``'s schedulers and ``train.py``'s momentum generator) gave at
every update step, recorded by tools/parity/schedules.py. octfw's
``cosine-no-restart`` configured with the same numbers must give the same
floats: compared with ``==``, no tolerance (the expressions are evaluated in the
reference's order). docs/reference-parity.md maps each option.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from octfw.display.errors import UserError
from octfw.plugins.schedulers.cosine import CosineConfig
from octfw.plugins.schedulers.cosine import build as build_cosine
from octfw.types import BuildContext

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "reference" / "schedules.json").read_text())
CONFIGURATIONS = FIXTURE["configurations"]


def octfw_schedule(opt: dict):
    """cosine-no-restart set up as a V-JEPA optimisation table: the mapping docs/reference-parity.md gives."""
    warmup_steps = int(opt["warmup"] * opt["ipe"])  # init_opt: int(warmup * iterations_per_epoch)
    config = CosineConfig(
        warmup=warmup_steps if warmup_steps else 0.0,
        warmup_start_lr=opt["start_lr"],
        min_lr=opt["final_lr"],
        decay="linear" if opt.get("is_anneal", False) else "cosine",
        horizon_scale=opt["ipe_scale"],
        ema_start=opt["ema"][0],
        ema_end=opt["ema"][1],
        ema_shape="linear",
        weight_decay_end=opt["final_weight_decay"],
    )
    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                       base_lr=opt["lr"], weight_decay=opt["weight_decay"],
                       total_update_steps=opt["epochs"] * opt["ipe"])
    return build_cosine(config, ctx)


def test_the_fixture_names_the_reference_commit_and_covers_each_phase():
    assert FIXTURE["reference"]["repo"].endswith("facebookresearch/vjepa2")
    assert len(FIXTURE["reference"]["commit"]) == 40
    cooldown = CONFIGURATIONS["vitl16-cooldown"]
    assert cooldown["optimization"]["is_anneal"] and cooldown["optimization"]["warmup"] == 0
    vjepa1 = CONFIGURATIONS["vjepa1-vitl16"]
    # The cosine, the weight-decay ramp and the EMA ramp all move in this one.
    assert vjepa1["lr"][0] < max(vjepa1["lr"]) and vjepa1["lr"][-1] < max(vjepa1["lr"])
    assert vjepa1["weight_decay"][-1] > vjepa1["weight_decay"][0]
    assert vjepa1["ema_momentum"][-1] > vjepa1["ema_momentum"][0]


@pytest.mark.parametrize("name", [n for n in CONFIGURATIONS if n != "vitl16-pretrain"])
def test_lr_weight_decay_and_ema_equal_vjepa_at_every_update_step(name):
    recorded = CONFIGURATIONS[name]
    schedule = octfw_schedule(recorded["optimization"])
    assert schedule.total_update_steps == recorded["steps"]
    for quantity in ("lr", "weight_decay", "ema_momentum"):
        ours = [getattr(schedule, quantity)(step) for step in range(recorded["steps"])]
        mismatched = [(s, a, b) for s, (a, b) in enumerate(zip(ours, recorded[quantity])) if a != b]
        assert not mismatched, f"{name} {quantity}: first (step, octfw, vjepa2) {mismatched[:3]}"


def test_ipe_scale_stops_the_run_short_of_the_end_values_as_vjepa_does():
    # 300 of 375 horizon steps: neither the LR floor nor the EMA's 1.0 is reached.
    recorded = CONFIGURATIONS["vjepa1-vitl16"]
    schedule = octfw_schedule(recorded["optimization"])
    last = recorded["steps"] - 1
    assert schedule.lr(last) > 50 * recorded["optimization"]["final_lr"]
    assert schedule.ema_momentum(last) == recorded["ema_momentum"][last] < 1.0


def test_the_published_pretrain_table_as_written_is_refused_its_warmup_outlasts_the_run():
    # Documented difference: 10 epochs with a 40-epoch warmup never leave the warmup in the
    # reference (its LR ends at 2.06e-4 of 5.25e-4); octfw refuses a warmup longer than the run.
    recorded = CONFIGURATIONS["vitl16-pretrain"]
    assert max(recorded["lr"]) < recorded["optimization"]["lr"]
    with pytest.raises(UserError, match="warmup = 240 update steps is longer than the run"):
        octfw_schedule(recorded["optimization"])
