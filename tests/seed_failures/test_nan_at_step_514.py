"""Seed failure: the loss became N/A at update step 512/514 and the run
crashed; restarted, it crashed there again.

octfw's ``nan-skip`` guard skips an update whose loss (or gradient) is not
finite, on the device, and the run goes on to the end. A shorter variant of
tests/test_engine.py's step-514 test: instead of training 513 updates first,
the run resumes from a checkpoint whose counters say update 512 (the probe
model counts its calls in a buffer, so micro-step 514 is update 514 here too).
"""

import json

import torch

from test_engine import PROBE_PLUGIN

from seedkit import install_plugin, metrics, train, write_tiny

GUARDS = '[[guard]]\nname = "nan-skip"\n[[guard]]\nname = "grad-clip"\nmax_norm = 0.01\n'


def test_non_finite_loss_at_update_514_is_skipped_and_the_run_completes(tmp_path, monkeypatch):
    install_plugin(monkeypatch, tmp_path, "plug_probe", PROBE_PLUGIN)
    recipe = write_tiny(tmp_path, GUARDS)
    common = ["model.name=poisoned", "model.nan_at=[514]", "engine.log_every_steps=2",
              "transform.image_size=[4, 16, 16]", "model.patch_size=[2, 8, 8]"]
    first, _ = train(recipe, ["run.max_steps=2", "scheduler.warmup=1", *common])
    state = torch.load(first.checkpoint, weights_only=True)
    state.update(update_step=512, samples_done=512 * 2)
    # the checkpoint stands for update 512 of the 516-step run: it records that run's recipe
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    state["recipe"] = load_recipe(recipe, ["run.max_steps=516", "scheduler.warmup=20", *common],
                                  load_registry()).to_dict()
    state["model"]["calls"] = torch.tensor(512)
    at_512 = tmp_path / "step_00000512.pt"
    torch.save(state, at_512)

    summary, run_dir = train(recipe, ["run.max_steps=516", "scheduler.warmup=20", *common], resume=str(at_512))
    assert summary.update_steps == 516 and summary.stopped is None
    assert summary.skipped_updates == 1
    lines = metrics(run_dir)
    assert [(line["step"], line["skipped_updates"]) for line in lines] == [(514, 1), (516, 1)]
    assert lines[0]["loss"] is not None  # update 513 was applied; 514's NaN is not averaged in
    event = json.loads((run_dir / "guard_events.jsonl").read_text().splitlines()[0])
    assert event["step"] == 514 and event["recent_batches"][-1]["step"] == 514
