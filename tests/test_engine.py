"""The training engine on the CPU: guarded updates, quarantine, resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from octfw.engine.trainer import train
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.runs.folder import create_run_dir

from conftest import make_dist

# A test plugin: a model that wraps vjepa3d and poisons the loss on chosen
# micro-steps (counted on the device, no sync), plus a guard that records what
# it sees on every update step.
PROBE_PLUGIN = '''
import attrs, torch
from octfw.hookspecs import hookimpl
from octfw.types import ModelOutput

RECORD = []

@attrs.frozen
class PoisonConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)
    nan_at: tuple[int, ...] = ()
    where: str = "loss"
    rank_only: int = -1  # poison on this torchrun rank only (-1: every rank)
    loss_is_domain_id: bool = False  # per-sample loss = the batch's domain id + 1

class Poisoned(torch.nn.Module):
    def __init__(self, inner, nan_at, where, loss_is_domain_id=False):
        super().__init__()
        self.inputs = inner.inputs  # what the wrapped model reads
        self.inner, self.where, self.loss_is_domain_id = inner, where, loss_is_domain_id
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        # A plain attribute, not a buffer: DDP would overwrite buffers with rank 0's.
        self.bad = torch.tensor(list(nan_at) or [-1])
    def forward(self, batch):
        out = self.inner(batch)
        if self.loss_is_domain_id:
            per_sample = batch["domain_id"].float() + 1.0 + 0.0 * out.per_sample_loss
            out = ModelOutput(per_sample.mean(), per_sample, out.metrics)
        self.calls += 1
        poison = torch.isin(self.calls, self.bad)
        if self.where == "grad":  # a non-finite gradient in one parameter only
            p = self.inner.predictor_norm_weight()
            return ModelOutput(out.loss + (p * torch.where(poison, float("nan"), 0.0)).sum(), out.per_sample_loss, out.metrics)
        return ModelOutput(torch.where(poison, float("nan"), out.loss), out.per_sample_loss, out.metrics)
    def ema_update(self, momentum):
        self.inner.ema_update(momentum)
    def param_groups(self, weight_decay):
        return self.inner.param_groups(weight_decay)

def build_model(config, ctx):
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build
    inner = build(VJEPA3DConfig(preset="tiny", patch_size=config.patch_size), ctx)
    if config.rank_only >= 0 and ctx.rank != config.rank_only:
        config = attrs.evolve(config, nan_at=())
    inner.predictor_norm_weight = lambda: next(p for n, p in inner.predictor.named_parameters() if p.ndim == 1)
    return Poisoned(inner, config.nan_at, config.where, config.loss_is_domain_id)

@attrs.frozen
class RecorderConfig:
    params_at: tuple[int, ...] = ()  # update steps whose parameters are kept (empty: all)

class Recorder:
    def __init__(self, config):
        self.params_at = set(config.params_at)
    def before_step(self, inputs):
        keep = not self.params_at or inputs.update_step in self.params_at
        RECORD.append({"step": inputs.update_step, "grad_norm": inputs.grad_norm.detach().clone(),
                       "lr": inputs.lr, "params": [p.detach().clone() for p in inputs.parameters] if keep else None})
        return None
    def at_log_step(self, update_step, metrics):
        pass

@attrs.frozen
class ChecksumConfig:
    pass

class Checksum:
    """Writes this rank's parameter checksum at every log step (for DDP tests)."""
    def __init__(self, ctx):
        self.rank, self.run_dir, self.params = ctx.rank, ctx.run_dir, None
    def before_step(self, inputs):
        self.params = inputs.parameters
        return None
    def at_log_step(self, update_step, metrics):
        total = float(sum(p.detach().double().sum() for p in self.params))
        with open(self.run_dir / f"checksum_rank{self.rank}.txt", "a") as f:
            f.write(f"{update_step} {total!r}\\n")

@hookimpl
def octfw_register_models(register):
    register("poisoned", PoisonConfig, build_model, "vjepa3d with NaN losses on chosen micro-steps")

@hookimpl
def octfw_register_guards(register):
    register("recorder", RecorderConfig, lambda c, ctx: Recorder(c), "records guard inputs")
    register("checksum", ChecksumConfig, lambda c, ctx: Checksum(ctx), "per-rank parameter checksums")
'''


@pytest.fixture
def probe(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("probe-site")
    make_dist(root, "octfw-probe", "plug_probe", PROBE_PLUGIN)
    monkeypatch.syspath_prepend(str(root))
    import importlib
    import sys

    sys.modules.pop("plug_probe", None)
    module = importlib.import_module("plug_probe")
    yield module
    sys.modules.pop("plug_probe", None)


def run(recipe_path: Path, overrides=(), resume=None, run_dir=None):
    registry = load_registry()
    recipe = load_recipe(recipe_path, overrides, registry)
    run_dir = run_dir or create_run_dir(recipe, registry)
    return train(recipe, registry, run_dir, resume=resume), run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_non_finite_update_is_skipped_bitwise_and_the_run_completes(tiny_recipe, probe, where):
    recipe_overrides = ["run.max_steps=8", "model.name=poisoned", "model.nan_at=[5]", f"model.where={where}",
                        "engine.log_every_steps=1"]
    text = tiny_recipe.read_text() + '\n[[guard]]\nname = "recorder"\n[[guard]]\nname = "nan-skip"\n' \
        '[[guard]]\nname = "grad-clip"\nmax_norm = 1.0\n'
    tiny_recipe.write_text(text)
    summary, run_dir = run(tiny_recipe, recipe_overrides)
    assert summary.update_steps == 8 and summary.skipped_updates == 1
    record = probe.RECORD
    assert [r["step"] for r in record] == list(range(8))
    # Micro-step 5 is update step 4: what step 5 starts from equals what step 4 started from.
    for before, after in zip(record[4]["params"], record[5]["params"]):
        assert torch.equal(before, after)
    assert any(not torch.equal(a, b) for a, b in zip(record[3]["params"], record[4]["params"]))
    applied = [r["grad_norm"] for i, r in enumerate(record) if i != 4]
    assert all(torch.isfinite(g) and g > 0 for g in applied)
    if where == "grad":
        assert not torch.isfinite(record[4]["grad_norm"])
    lines = metrics(run_dir)
    assert [line["skipped_updates"] for line in lines] == [0, 0, 0, 0, 1, 1, 1, 1]
    # The only update of log step 5 was skipped: no loss to report, never a fake one.
    assert [line["loss"] is None for line in lines] == [i == 4 for i in range(8)]
    events = [json.loads(line) for line in (run_dir / "guard_events.jsonl").read_text().splitlines()]
    assert events[0]["step"] == 5 and events[0]["recent_batches"][-1]["step"] == 5  # the 5th update
    assert all(s["source"].endswith(".dcm") for s in events[0]["recent_batches"][-1]["samples"])


def test_loss_is_logged_per_domain_from_each_samples_domain(tiny_recipe, probe):
    # The probe's per-sample loss is its domain id + 1: heidelberg 1, topcon 2, zeiss 3.
    summary, run_dir = run(tiny_recipe, ["run.max_steps=6", "model.name=poisoned", "model.loss_is_domain_id=true",
                                         "engine.grad_accum_steps=2", "engine.log_every_steps=2"])
    lines = metrics(run_dir)
    expected = {"loss/heidelberg": 1.0, "loss/topcon": 2.0, "loss/zeiss": 3.0}
    seen = set()
    for line in lines:
        per_domain = {k: v for k, v in line.items() if k.startswith("loss/")}
        assert per_domain and all(v == expected[k] for k, v in per_domain.items())
        seen |= set(per_domain)
    assert seen == set(expected)  # 24 samples over 8 volumes: every domain appears


def test_each_sample_carries_the_id_of_its_own_domain(tiny_recipe):
    from octfw.engine.build import build_components
    from octfw.engine.collate import collate
    from octfw.engine.data import SampleSource

    registry = load_registry()
    parts = build_components(load_recipe(tiny_recipe, [], registry), registry, run_dir=None, with_loggers=False)
    assert parts.domains == ["heidelberg", "topcon", "zeiss"]
    source = SampleSource(parts.dataset, parts.transform, seed=0, domains=parts.domains)
    items = [source[(0, i)] for i in range(len(parts.dataset))]
    batch = collate(items, parts.transform.batch_spec())
    assert batch["tensors"]["domain_id"].dtype == torch.int64
    assert batch["tensors"]["domain_id"].tolist() == [parts.domains.index(p.domain) for p in batch["provenance"]]
    assert {p.domain for p in batch["provenance"]} == set(parts.domains)


def test_lr_is_monotonic_after_warmup_and_positive_from_the_first_update(tiny_recipe):
    summary, run_dir = run(tiny_recipe, ["run.max_steps=12", "scheduler.warmup=3"])
    lrs = [line["lr"] for line in metrics(run_dir)]
    assert lrs[0] > 0
    assert lrs[:3] == sorted(lrs[:3]) and lrs[2:] == sorted(lrs[2:], reverse=True)


def test_corrupt_files_are_skipped_listed_once_and_no_good_file_is_dropped(tiny_recipe):
    summary, run_dir = run(tiny_recipe, ["dataset.n_volumes=10", "dataset.corrupt_fraction=0.2",
                                         "run.max_steps=10", "engine.per_device_batch=2"])
    assert summary.update_steps == 10
    quarantined = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert len(quarantined) == len({q["url"] for q in quarantined}) == 2
    assert summary.quarantined == 2
    assert all(q["reason"] for q in quarantined)


def test_resume_continues_bitwise_equal_to_an_uninterrupted_run(tiny_recipe, tmp_path):
    overrides = ["run.max_steps=6", "engine.checkpoint_every_steps=3"]
    full, full_dir = run(tiny_recipe, overrides)
    reference = metrics(full_dir)

    # An interrupted twin: the same run, killed after its step-3 checkpoint.
    twin_dir = tmp_path / "twin"
    shutil.copytree(full_dir, twin_dir)
    checkpoints = twin_dir / "checkpoints"
    (checkpoints / "step_00000006.pt").unlink()
    (checkpoints / "latest").write_text("step_00000003.pt")
    (twin_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in reference[:3]))
    resumed, _ = run(tiny_recipe, overrides, resume="auto", run_dir=twin_dir)
    after = metrics(twin_dir)
    assert resumed.update_steps == 6
    assert [m["loss"] for m in after[3:]] == [m["loss"] for m in reference[3:]]
    assert [m["grad_norm"] for m in after[3:]] == [m["grad_norm"] for m in reference[3:]]


def test_nan_at_update_514_is_skipped_and_the_run_goes_on(tiny_recipe, probe):
    """The seeds' step 514: a non-finite loss there skips exactly that update."""
    text = tiny_recipe.read_text() + '\n[[guard]]\nname = "recorder"\nparams_at = [513, 514]\n' \
        '[[guard]]\nname = "nan-skip"\n[[guard]]\nname = "grad-clip"\nmax_norm = 1.0\n'
    tiny_recipe.write_text(text)
    summary, run_dir = run(tiny_recipe, [
        "run.max_steps=530", "model.name=poisoned", "model.nan_at=[514]",  # micro-step 514 = update 514
        "engine.log_every_steps=10", "scheduler.warmup=20", "transform.image_size=[4, 16, 16]",
        "model.patch_size=[2, 8, 8]"])
    assert summary.update_steps == 530 and summary.skipped_updates == 1 and summary.stopped is None
    record = probe.RECORD
    # record[i] is taken before the (i+1)-th update: update 514 changed nothing.
    for before, after in zip(record[513]["params"], record[514]["params"]):
        assert torch.equal(before, after)
    norms = [r["grad_norm"] for r in record]
    assert all(torch.isfinite(n) and n > 0 for i, n in enumerate(norms) if i != 513)
    lrs = [r["lr"] for r in record]
    assert lrs[19:] == sorted(lrs[19:], reverse=True) and min(lrs) > 0
    lines = metrics(run_dir)
    assert [line["skipped_updates"] for line in lines if line["step"] in (510, 520)] == [0, 1]


def test_loss_spike_guard_warns_with_the_step(capsys):
    from octfw.plugins.guards.loss_spike import LossSpike, LossSpikeConfig
    from octfw.types import StopTraining

    guard = LossSpike(LossSpikeConfig(factor=3.0, min_history=3))
    for step, loss in enumerate([1.0, 0.9, 1.1, 1.0, 5.0], start=1):
        guard.at_log_step(step * 10, {"loss": loss})
    assert "loss-spike: loss 5 at update step 50 is 5.0x the running median 1" in capsys.readouterr().err
    stopper = LossSpike(LossSpikeConfig(factor=2.0, min_history=2, action="stop"))
    stopper.at_log_step(1, {"loss": 1.0})
    stopper.at_log_step(2, {"loss": 1.0})
    stopper.at_log_step(3, {"loss": float("nan")})  # ignored, not a spike
    with pytest.raises(StopTraining, match="update step 4"):
        stopper.at_log_step(4, {"loss": 2.5})


def test_a_weight_decay_schedule_rising_from_zero_reaches_the_decaying_groups_only(tiny_recipe):
    """engine.weight_decay = 0 with weight_decay_end > 0: the groups that decay are
    known from the model, not from their current value (which is 0 for all of them)."""
    from octfw.engine.trainer import Trainer
    from octfw.engine.plan import plan_for_folder

    registry = load_registry()
    recipe = load_recipe(tiny_recipe, ["engine.weight_decay=0.0", "scheduler.weight_decay_end=0.2",
                                       "run.max_steps=4"], registry)
    trainer = Trainer(plan_for_folder(recipe, registry, create_run_dir(recipe, registry)), registry)
    groups = {group["name"]: group for group in trainer.optimizer.param_groups}
    assert groups["decay"]["weight_decay"] == groups["no_decay"]["weight_decay"] == 0.0
    for step in range(3):
        trainer.update(step)
    assert groups["decay"]["weight_decay"] == pytest.approx(trainer.parts.scheduler.weight_decay(2))
    assert groups["decay"]["weight_decay"] > 0.0
    assert groups["no_decay"]["weight_decay"] == 0.0
