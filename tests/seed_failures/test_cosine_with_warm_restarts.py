"""Seed failure: the "cosine" schedule was CosineAnnealingWarmRestarts; the LR
jumped 10x at each restart (0.00005 -> 0.0005) and the loss exploded at step
512/514.

octfw simulates every schedule over the whole run before training and refuses
one whose LR rises after warmup, naming the update step: ``octfw check`` and
``octfw run`` exit with code 2 before a single update."""

import pytest

from seedkit import cli, install_plugin, write_tiny

PERIOD = 5  # update steps per cosine cycle

RESTARTS = '''
import math
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class RestartsConfig:
    period: int = 5

class WarmRestarts:
    """torch's CosineAnnealingWarmRestarts(T_0=period, eta_min=0.1 x base_lr), by update step."""
    def __init__(self, config, ctx):
        self.base, self.period = ctx.base_lr, config.period
    def lr(self, step):
        t = (step % self.period) / self.period
        low = 0.1 * self.base
        return low + (self.base - low) * 0.5 * (1 + math.cos(math.pi * t))
    def weight_decay(self, step):
        return None
    def ema_momentum(self, step):
        return 0.996

@hookimpl
def octfw_register_schedulers(register):
    register("cosine-warm-restarts", RestartsConfig, lambda c, ctx: WarmRestarts(c, ctx),
             "cosine with warm restarts (the seeds' hidden scheduler)")
'''


@pytest.mark.parametrize("command", ["check", "run"])
def test_schedule_with_restarts_is_refused_before_training_with_the_step(tmp_path, monkeypatch, capsys, command):
    install_plugin(monkeypatch, tmp_path, "plug_restarts", RESTARTS)
    recipe = write_tiny(tmp_path)
    code, out, err = cli(capsys, command, recipe, "--set", "run.max_steps=12",
                         "--set", 'scheduler={name="cosine-warm-restarts"}')
    assert code == 2
    assert f"lr rises after warmup at update step {PERIOD}" in err and "restarts is refused" in err
    assert not list(tmp_path.glob("runs/**/metrics.jsonl"))  # not one update was trained
