"""The engine's accelerator paths, run on the CPU here and on CUDA by
``scripts/accelerator_suite.sh`` (``pytest -m cuda``).

Each test is parametrized over the device: the ``cpu`` variant runs in the
default suite and proves the test's logic; the ``cuda`` variant carries the
``cuda`` marker and is skipped where torch sees no CUDA device, so the suite
never depends on a GPU. On CUDA the engine takes the paths the CPU never
takes: bf16 autocast on the GPU, GatedAdamW with the guards' verdict kept
on the device, and checkpoints whose tensors live on another device.
"""

from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import pytest
import torch

from octfw.diagnostics.attention import record_attention
from octfw.engine.optim import GatedAdamW
from octfw.engine.trainer import Trainer
from octfw.engine.plan import plan_for_folder
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.runs.folder import create_run_dir

CUDA_SKIP = "needs a CUDA device (run scripts/accelerator_suite.sh on a GPU machine)"


def _device_param(device: str):
    if device == "cpu":
        return pytest.param("cpu", id="cpu")
    return pytest.param(device, id=device, marks=[
        pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP)])


DEVICES = [_device_param("cpu"), _device_param("cuda")]


def make_trainer(recipe_path: Path, device: str, *overrides: str, resume: str | None = None) -> Trainer:
    """The real Trainer on ``device`` for the tiny test recipe."""
    registry = load_registry()
    recipe = load_recipe(recipe_path, [f"run.device={device}", "run.max_steps=50", *overrides], registry)
    return Trainer(plan_for_folder(recipe, registry, create_run_dir(recipe, registry), resume), registry)


def fixed_batches(trainer: Trainer, poisoned_at: set[int] = frozenset()):
    """One real batch of the trainer's own loader, yielded again and again; at
    the micro-steps in ``poisoned_at`` its context view is all NaN, so the loss
    and every gradient are non-finite."""
    batch = next(trainer.batches)  # read now: the caller replaces trainer.batches with the result
    poisoned = {**batch, "tensors": dict(
        batch["tensors"], context=torch.full_like(batch["tensors"]["context"], float("nan")))}
    return (poisoned if micro_step in poisoned_at else batch for micro_step in itertools.count())


def training_state(trainer: Trainer) -> list[torch.Tensor]:
    """Copies of what an update may change: parameters, EMA (target encoder)
    and every optimizer state tensor (moments and step counts)."""
    model = trainer.model
    optimizer_state = [t for p in trainer.parameters for t in trainer.optimizer.state.get(p, {}).values()
                       if torch.is_tensor(t)]
    tensors = [*model.state_dict().values(), *optimizer_state]
    return [t.detach().clone() for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_step_trains_fp32_weights_with_bf16_attention(tiny_recipe, device):
    trainer = make_trainer(tiny_recipe, device, "engine.precision=bf16", "engine.base_lr=3e-3")
    trainer.batches = fixed_batches(trainer)
    losses = []
    for update_step in range(8):
        with record_attention() as attention:
            _, out = trainer.update(update_step)
        losses.append(out.loss.detach().float())
    losses = torch.stack(losses).cpu()
    assert torch.isfinite(losses).all()
    # Autocast computes in bf16; the weights the optimizer updates stay fp32.
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert out.loss.dtype == torch.float32  # the loss is taken in fp32 whatever autocast does
    assert {call.dtype for call in attention.calls} == {"bfloat16"}
    assert "math" not in attention.kernels
    # The same batch every step: training must fit it.
    assert losses[-1] < 0.9 * losses[0], losses.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_update_leaves_parameters_moments_and_ema_bitwise_unchanged(tiny_recipe, device):
    """On CUDA the guards' verdict stays on the device and GatedAdamW takes it
    into the update (no host sync); on the CPU the verdict is read on the host."""
    trainer = make_trainer(tiny_recipe, device, 'guard=[{name="nan-skip"}, {name="grad-clip", max_norm=1.0}]',
                           "engine.precision=fp32")
    assert isinstance(trainer.optimizer, GatedAdamW) == (device != "cpu")
    trainer.batches = fixed_batches(trainer, poisoned_at={3})
    for update_step in range(3):  # moments and EMA exist and have moved before the poisoned step
        trainer.update(update_step)
    before = training_state(trainer)
    _, out = trainer.update(3)
    assert not torch.isfinite(out.loss).item()
    after = training_state(trainer)
    assert len(after) == len(before) > 2 * len(trainer.parameters)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if not torch.equal(a, b)]
    assert changed == []
    assert float(trainer.totals.skipped) == 1.0
    trainer.update(4)  # the next finite update is applied again
    assert any(not torch.equal(a, b) for a, b in zip(after, training_state(trainer)))


def _grads(parameters: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=generator).mul_(1e-2).to(p.device) for p in parameters]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verdict", [None, True])
def test_gated_adamw_matches_torch_adamw_on_the_model(tiny_recipe, device, verdict):
    """GatedAdamW against torch's fastest AdamW for the device (fused on CUDA,
    multi-tensor on the CPU) on vjepa3d's parameter groups, with the LR and
    weight decay rewritten every update as the schedule does."""
    trainer = make_trainer(tiny_recipe, device, "engine.precision=fp32")
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}
    reference_model, gated_model = copy.deepcopy(trainer.model), copy.deepcopy(trainer.model)
    impl = {"fused": True} if device != "cpu" else {"foreach": True}
    reference = torch.optim.AdamW(reference_model.param_groups(0.05), **hyper, **impl)
    gated = GatedAdamW(gated_model.param_groups(0.05), **hyper)
    applied = None if verdict is None else torch.tensor(verdict, device=device)
    ref_params = [p for p in reference_model.parameters() if p.requires_grad]
    gated_params = [p for p in gated_model.parameters() if p.requires_grad]
    for step in range(12):
        for params in (ref_params, gated_params):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
        for group in reference.param_groups + gated.param_groups:
            group["lr"] = hyper["lr"] * (1 - step / 24)
        reference.step()
        gated.step(applied)
    for a, b in zip(ref_params, gated_params):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    moved = max(float((a - b).detach().abs().max()) for a, b in zip(ref_params, trainer.parameters))
    assert moved > 1e-3  # both moved: not a comparison of two untouched models


def _cpu_state(trainer: Trainer) -> tuple[dict, dict]:
    """Model and optimizer state on the host, in torch.optim.AdamW's layout."""
    from octfw.engine.state import host_copy

    optimizer = host_copy(trainer.optimizer.state_dict())
    hyper = ("lr", "betas", "eps", "weight_decay")
    groups = [{k: g[k] for k in hyper} for g in optimizer["param_groups"]]
    return host_copy(trainer.model.state_dict()), {"state": optimizer["state"], "groups": groups}


def _assert_equal_states(a, b) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_states(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("source, target", [
    pytest.param("cpu", "cpu", id="cpu-to-cpu"),
    *(pytest.param(s, t, id=f"{s}-to-{t}", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP)])
      for s, t in (("cuda", "cpu"), ("cpu", "cuda"))),
])
def test_checkpoint_moves_between_devices_with_identical_state(tiny_recipe, source, target):
    """Saved through the real checkpointer on one device, resumed by the real
    Trainer on the other: weights, EMA, moments and step counts identical, and
    the next update agrees (to the devices' rounding)."""
    first = make_trainer(tiny_recipe, source, "engine.precision=fp32")
    first.batches = fixed_batches(first)
    for update_step in range(3):
        first.update(update_step)
    assert first.run_end.save_final(3) == (False, None)  # written: no failure, no fallback copy
    assert not first.saver.failed and first.saver.latest
    resumed = make_trainer(tiny_recipe, target, "engine.precision=fp32", resume=first.saver.latest)
    assert resumed.start_step == 3
    assert all(p.device.type == target for p in resumed.model.parameters())
    _assert_equal_states(_cpu_state(first), _cpu_state(resumed))

    # The first trainer's batch on the target device: both take the same next update.
    batch = next(first.batches)
    resumed.batches = itertools.repeat({**batch, "tensors": {k: v.to(resumed.backend.device)
                                                             for k, v in batch["tensors"].items()}})
    first.update(3)
    resumed.update(3)
    for a, b in zip(first.model.state_dict().values(), resumed.model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L4", 121),
    ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA B200", 2250), ("NVIDIA GeForce RTX 3090", None),
])
def test_mfu_peak_is_the_form_factors_published_dense_bf16_figure(name, tflops):
    """The suite's and the engine's MFU divide by this: an H100 PCIe is not an SXM, an L40 not an L4."""
    from octfw.engine.throughput import published_peak

    assert published_peak(name) == (None if tflops is None else tflops * 1e12)


@pytest.mark.parametrize("accelerator_type, tflops", [
    ("v4-32", 275), ("v5litepod-16", 197), ("v5p-8", 459), ("v6e-8", 918), ("v3-8", None),
])
def test_a_tpu_slice_is_known_by_its_chip_for_mfu(accelerator_type, tflops):
    """torch_xla's version() says 5 for a v5e and a v5p alike: the accelerator type tells them apart."""
    from octfw.engine.throughput import published_peak, tpu_name

    assert published_peak(tpu_name(accelerator_type)) == (None if tflops is None else tflops * 1e12)


class _DeviceTensorsFromPython(torch.overrides.TorchFunctionMode):
    """Notes every tensor octfw's code makes from Python data with an explicit device: on CUDA
    each is a copy from pageable host memory that makes the host wait
    (``torch.tensor(0.99, device=cuda)``). torch's own code is left to the CUDA check (its
    CPU AdamW makes host step counts, which never touch a device)."""

    FACTORIES = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.Tensor.new_tensor}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else None)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if (func in self.FACTORIES and kwargs.get("device") is not None and not torch.is_tensor(data)
                and caller.startswith("octfw")):
            self.calls.append(f"{func.__name__}({data!r}, device={kwargs['device']})")
        return func(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_update_steps_never_make_the_host_wait_for_the_device(tiny_recipe, device):
    """The whole update step, from the real loader (pinned, non-blocking) through the guards,
    GatedAdamW and the EMA: no tensor from a Python number on the device (checked everywhere)
    and, on CUDA, no host-device synchronisation at all (``set_sync_debug_mode("error")``
    raises at the first)."""
    trainer = make_trainer(tiny_recipe, device, "engine.precision=bf16", "engine.log_every_steps=1000",
                           "engine.num_workers=1", 'scheduler={name="cosine-no-restart", warmup=2}',
                           'guard=[{name="nan-skip"}, {name="grad-clip", max_norm=1.0}, {name="lr-positive"}]')
    for update_step in range(2):  # warm-up: the first step records the attention kernel, lazily built state
        trainer.update(update_step)
    made = _DeviceTensorsFromPython()
    with made:
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for update_step in range(2, 6):
                trainer.update(update_step)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert made.calls == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flip_prob", [0.0, 1.0])
def test_a_volume_both_views_share_travels_once_from_pinned_memory(tiny_recipe, device, flip_prob):
    from octfw.engine.data import SampleSource, make_loader

    trainer = make_trainer(tiny_recipe, device, f"transform.flip_prob={flip_prob}")
    parts = trainer.parts
    source = SampleSource(parts.dataset, parts.transform, 0, parts.domains)
    loader = make_loader(source, 2, seed=0, start=0, num_workers=1, pin_memory=device == "cuda")
    host = next(iter(loader))
    shared = flip_prob == 0.0
    assert host["aliases"] == ({"target": "context"} if shared else {})
    assert ("target" in host["tensors"]) is not shared
    if device == "cuda":
        assert all(t.is_pinned() for t in host["tensors"].values())
    (batch,) = itertools.islice(trainer.backend.device_batches([host], parts.transform.batch_spec()), 1)
    views = batch["tensors"]
    assert (views["target"] is views["context"]) is shared
    assert views["context"].device.type == device and views["context"].dtype == torch.float32
    trainer.update(0)  # the model takes the batch as the engine hands it


def test_the_run_summary_names_the_attention_kernel_that_ran(tiny_recipe):
    from octfw.engine.trainer import train
    from octfw.recipe import load_recipe as load

    registry = load_registry()
    recipe = load(tiny_recipe, ["run.max_steps=1"], registry)
    summary = train(recipe, registry, create_run_dir(recipe, registry))
    # CPU fp32 at 8 tokens: PyTorch's flash kernel for the CPU runs it.
    assert summary.attention == "flash"
