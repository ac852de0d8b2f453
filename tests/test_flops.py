"""FLOPs per sample, counted with FlopCounterMode; the line `octfw check` prints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from octfw.models.flops import forward_flops_per_sample, training_flops_per_sample
from octfw.types import ModelOutput

from test_vjepa3d import make_batch, make_model

PATCH = (4, 8, 8)


def tiny(image_size):
    torch.manual_seed(0)
    model = make_model(image_size=image_size, patch_size=PATCH)
    return model, make_batch(model, batch_size=2, num_target=int(0.6 * model.num_patches))


def test_tiny_counts_are_positive_and_training_costs_more_than_forward():
    model, batch = tiny((8, 32, 32))
    forward = forward_flops_per_sample(model, batch)
    training = training_flops_per_sample(model, batch)
    assert isinstance(forward, int) and isinstance(training, int)
    assert 0 < forward < training < 4 * forward


def test_count_is_per_sample():
    model, batch = tiny((8, 32, 32))
    one = {k: v[:1] for k, v in batch.items()}
    # Equal but for the collapse metric, computed once over the whole batch.
    assert training_flops_per_sample(model, one) == pytest.approx(
        training_flops_per_sample(model, batch), rel=0.01)


def test_count_grows_with_tokens_and_faster_than_linearly():
    small_model, small_batch = tiny((8, 32, 32))  # 32 patches
    large_model, large_batch = tiny((8, 64, 64))  # 128 patches
    ratio = training_flops_per_sample(large_model, large_batch) / training_flops_per_sample(
        small_model, small_batch)
    tokens = large_model.num_patches / small_model.num_patches
    # At least linear in tokens; above it because attention is quadratic.
    assert tokens < ratio < tokens**2


def test_attention_is_counted_beyond_six_times_parameters_times_tokens():
    # 1,024 tokens of width 96: attention is most of the work. The linear
    # layers alone come to less than 6 x trainable x tokens here (the context
    # encoder sees only the visible 40%), so only attention can push it above.
    model, batch = tiny((16, 128, 128))
    trainable = model.count_parameters()["trainable"]
    assert training_flops_per_sample(model, batch) > 6 * trainable * model.num_patches


def test_counting_leaves_parameters_gradients_and_rng_untouched():
    model, batch = tiny((8, 32, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    training_flops_per_sample(model, batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


class ReadsOnTheHost(nn.Module):
    """A model with a host read in forward: it cannot run on the meta device."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, batch):
        y = self.linear(batch["x"])
        scale = float(y.abs().max().item()) + 1.0
        loss = (y / scale).square().mean()
        return ModelOutput(loss=loss, per_sample_loss=loss.expand(batch["x"].shape[0]))


def test_a_model_that_cannot_run_on_meta_is_counted_on_its_device():
    model = ReadsOnTheHost()
    batch = {"x": torch.randn(4, 8)}
    # One [8 x 8] matmul per sample: 2 x 64 FLOPs forward; backward adds the
    # weight gradient (the input needs none).
    assert forward_flops_per_sample(model, batch) == 2 * 64
    assert training_flops_per_sample(model, batch) == 2 * 2 * 64


def test_octfw_check_prints_and_returns_flops(tiny_recipe, registry):
    from octfw.diagnostics.check import check_recipe
    from octfw.recipe import load_recipe

    lines: list[str] = []
    result = check_recipe(load_recipe(tiny_recipe, (), registry), registry, report=lines.append)
    assert result["flops"]["training_step"] > result["flops"]["forward"] > 0
    line = next(line for line in lines if line.startswith("flops"))
    assert "GFLOP/sample" in line and "forward" in line and "training step" in line
    model_line = next(line for line in lines if line.startswith("model"))
    assert "trainable parameters" in model_line and "ema parameters" in model_line
