"""Seed failure: after the scheduler was switched off, ``train/lr`` read 0.0 and
nothing was learned (the optimizer had been built for the scheduler to set
the LR).

octfw's ``constant`` scheduler never rewrites the LR: the optimizer keeps
``engine.base_lr`` at every update, in the metrics and in the optimizer
itself (read back from the checkpoint)."""

import torch

from seedkit import metrics, train, write_tiny

BASE_LR = 1e-4


def test_constant_schedule_keeps_base_lr_at_every_update(tmp_path):
    recipe = write_tiny(tmp_path)
    summary, run_dir = train(recipe, ["run.max_steps=6", "engine.grad_accum_steps=2", "engine.log_every_steps=1",
                                      f"engine.base_lr={BASE_LR}", 'scheduler={name="constant"}'])
    lines = metrics(run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all(line["lr"] == BASE_LR for line in lines)
    state = torch.load(summary.checkpoint, weights_only=True)
    groups = state["optimizer"]["param_groups"]
    assert groups and all(g["lr"] == BASE_LR for g in groups)
    assert summary.first_loss != summary.last_loss  # something was learned
