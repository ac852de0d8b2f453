"""vjepa3d on torch_xla (CPU): the training step compiles once and never syncs.

torch_xla patches torch process-wide at import, so everything runs in a
subprocess with PJRT_DEVICE=CPU; the pytest process never imports it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STEPS = 22

# The training step of the engine in miniature: forward, backward, AdamW
# (octfw's GatedAdamW, as the engine builds it on xla, fed a device verdict), EMA with the
# momentum as a device tensor (1.0 on a non-finite loss), one sync per step.
# Every step gets a fresh random batch and fresh random masks of fixed size.
SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    from octfw.engine.optim import GatedAdamW
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build
    from octfw.types import BuildContext

    STEPS, BATCH, IMAGE, PATCH = int(sys.argv[1]), 2, (8, 32, 32), (4, 8, 8)
    CHECKPOINTING = sys.argv[2] == "1"

    def compilations():
        data = met.metric_data("CompileTime")
        return data[0] if data else 0

    def random_batch(n_target):
        n = model.num_patches
        perm = torch.stack([torch.randperm(n) for _ in range(BATCH)])
        batch = {
            "context": torch.randn(BATCH, 1, *IMAGE),
            "target": torch.randn(BATCH, 1, *IMAGE),
            "context_idx": perm[:, n_target:].contiguous(),
            "target_idx": perm[:, :n_target].contiguous(),
        }
        return {k: v.to(device) for k, v in batch.items()}

    torch.manual_seed(0)
    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0, image_size=IMAGE)
    device = torch_xla.device()
    model = build(VJEPA3DConfig(preset="tiny", patch_size=PATCH, activation_checkpointing=CHECKPOINTING),
                  ctx).to(device)
    optimizer = GatedAdamW(model.param_groups(0.05), lr=1e-3, betas=(0.9, 0.95))
    n_target = int(0.6 * model.num_patches)
    per_step, losses = [], []
    for step in range(STEPS):
        out = model(random_batch(n_target))
        losses.append(out.loss.detach())  # read on the host after the loop, not in it
        out.loss.backward()
        optimizer.step(torch.isfinite(out.loss))
        optimizer.zero_grad(set_to_none=True)
        momentum = torch.tensor(0.996 + 0.004 * step / STEPS, device=device)
        model.ema_update(torch.where(torch.isfinite(out.loss), momentum, 1.0))
        torch_xla.sync()
        per_step.append(compilations())
    counters = met.counter_names()

    # Control: a different number of masked patches is a new graph, and the
    # counter read above does see it.
    before = compilations()
    with torch.no_grad():
        probe = model(random_batch(n_target - 1))  # kept alive: sync runs only live graphs
    torch_xla.sync()
    changed_shape = compilations() - before

    metrics = {k: float(v.cpu()) for k, v in out.metrics.items()}
    print(json.dumps({"per_step": per_step, "counters": counters, "changed_shape": changed_shape,
                      "losses": [float(loss.cpu()) for loss in losses],
                      "loss": float(out.loss.detach().cpu()), "metrics": metrics,
                      "probe_loss": float(probe.loss.cpu())}))
""")


def run_on_xla(tmp_path_factory, steps: int, checkpointing: bool) -> dict:
    pytest.importorskip("torch_xla")  # the import happens in the subprocess only
    script = tmp_path_factory.mktemp("xla") / "step.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # The CPU backend's LLVM optimisation dominates compile time on tiny
        # graphs; it changes neither the graphs nor when they recompile.
        "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    }
    done = subprocess.run([sys.executable, str(script), str(steps), "1" if checkpointing else "0"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory) -> dict:
    return run_on_xla(tmp_path_factory, STEPS, checkpointing=False)


CHECKPOINTED_STEPS = 6


@pytest.fixture(scope="module")
def xla_checkpointed_run(tmp_path_factory) -> dict:
    return run_on_xla(tmp_path_factory, CHECKPOINTED_STEPS, checkpointing=True)


def test_training_step_compiles_once_over_many_steps(xla_run):
    per_step = xla_run["per_step"]
    assert len(per_step) == STEPS
    # Step 1 compiles the step without optimizer state, step 2 the steady
    # state; from then on every step reuses the cached graph.
    assert 1 <= per_step[1] <= 2
    assert per_step[-1] == per_step[1], per_step


def test_the_compile_counter_sees_a_change_of_shape(xla_run):
    assert xla_run["changed_shape"] >= 1


def test_training_step_never_reads_a_tensor_on_the_host(xla_run):
    assert "aten::_local_scalar_dense" not in xla_run["counters"]
    # No op fell back to the CPU either (fallbacks are counted as aten::*).
    assert not [c for c in xla_run["counters"] if c.startswith("aten::")], xla_run["counters"]


def test_training_step_on_xla_gives_finite_loss_and_metrics(xla_run):
    values = [xla_run["loss"], *xla_run["metrics"].values()]
    assert all(v == v and abs(v) < float("inf") for v in values), xla_run
    assert set(xla_run["metrics"]) >= {"target_std", "effective_rank"}


def test_activation_checkpointing_on_xla_trains_the_same_and_compiles_once(xla_run, xla_checkpointed_run):
    """torch_xla's own checkpoint (an optimization barrier keeps XLA from
    merging the recomputation away): same batches, same losses, one graph."""
    per_step = xla_checkpointed_run["per_step"]
    assert per_step[-1] == per_step[1], per_step
    # Not bitwise: XLA fuses the recomputed graph differently, and float32
    # rounding differences grow over the updates (1e-4 after five of them).
    assert xla_checkpointed_run["losses"][0] == pytest.approx(xla_run["losses"][0], rel=1e-6)
    assert xla_checkpointed_run["losses"] == pytest.approx(xla_run["losses"][:CHECKPOINTED_STEPS], rel=1e-3)
    assert not [c for c in xla_checkpointed_run["counters"] if c.startswith("aten::")]
