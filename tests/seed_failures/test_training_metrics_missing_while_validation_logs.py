"""Seed failure: for 8+ minutes W&B showed validation and system metrics but
no training metrics; nobody could tell whether the training loop ran.

octfw's heartbeat warns when no update step completes within
``engine.heartbeat_s`` and names what the loop is waiting on; here a dataset
that blocks makes the run print the line naming the data loader, and the run
still completes."""

from seedkit import install_plugin, train, write_tiny

STALLING = '''
import time
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class StallConfig:
    n_volumes: int = 8
    stall_s: float = 2.0
    stall_at_load: int = 4

class Stalling:
    """synthetic-oct whose N-th load blocks (a hung file system, a stuck worker)."""
    def __init__(self, inner, config):
        self.inner, self.config, self.loads = inner, config, 0
    def __len__(self):
        return len(self.inner)
    def domain(self, index):
        return self.inner.domain(index)
    def load(self, index):
        self.loads += 1
        if self.loads == self.config.stall_at_load:
            time.sleep(self.config.stall_s)
        return self.inner.load(index)

def build(config, ctx):
    from octfw.plugins.datasets.synthetic import SyntheticOctConfig, build as synthetic
    return Stalling(synthetic(SyntheticOctConfig(n_volumes=config.n_volumes), ctx), config)

@hookimpl
def octfw_register_datasets(register):
    register("stalling", StallConfig, build, "synthetic-oct with one blocking load")
'''


def test_heartbeat_names_the_data_loader_when_no_update_completes(tmp_path, monkeypatch, capsys):
    install_plugin(monkeypatch, tmp_path, "plug_stalling", STALLING)
    recipe = write_tiny(tmp_path)
    summary, _ = train(recipe, ['dataset={name="stalling"}', "engine.heartbeat_s=0.5", "run.max_steps=3"])
    err = capsys.readouterr().err
    assert summary.update_steps == 3
    beats = [line for line in err.splitlines() if line.startswith("octfw heartbeat:")]
    # (A slow first forward on a busy machine may add a line that names it.)
    stalled = [line for line in beats if line.endswith("waiting on the data loader")]
    assert stalled, err
    assert "no update step completed in" in stalled[0] and "since update step 1" in stalled[0]
