"""Seed failure: ``train/grad_norm`` was 0.0 at every step because it was read
with ``clip_grad_norm_`` after ``optimizer.zero_grad()``.

octfw measures the global norm once per update, before clipping and before
``zero_grad``, and logs that pre-clip value."""

from seedkit import metrics, train, write_tiny

CLIP = 0.01  # the seeds' ultra-strict clipping


def test_logged_grad_norm_is_the_pre_clip_norm_and_never_zero(tmp_path):
    recipe = write_tiny(tmp_path, f'[[guard]]\nname = "nan-skip"\n[[guard]]\nname = "grad-clip"\nmax_norm = {CLIP}\n')
    summary, run_dir = train(recipe, ["run.max_steps=6", "engine.grad_accum_steps=2", "engine.log_every_steps=1"])
    norms = [line["grad_norm"] for line in metrics(run_dir)]
    assert summary.update_steps == 6 and len(norms) == 6
    assert all(n is not None and n > 0 for n in norms)
    # Read after clipping, every value would be <= 0.01; after zero_grad, 0.
    assert all(n > 10 * CLIP for n in norms), norms
