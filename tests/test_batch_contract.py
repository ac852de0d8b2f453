"""The batch a transform makes is the transform's declaration (``batch_spec``), not the engine's.

A method that needs another input (here a per-voxel finding mask beside the two views)
declares it in its transform and reads it in its model: the key reaches the model on the
device through the real loader, with no engine file touched. A key returned but not
declared, a declared key of the wrong shape, and a model reading a key no transform makes
are each refused in one line, never dropped or reshaped silently.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from octfw.engine.build import build_components
from octfw.engine.collate import collate
from octfw.engine.data import SampleSource
from octfw.display.errors import ContractError, UserError
from octfw.recipe import load_recipe
from octfw.registry import DISABLE_ENV

from conftest import make_dist

PLUGIN = '''
import attrs
import numpy as np
import torch
from octfw.hookspecs import hookimpl
from octfw.types import BatchKey, ModelOutput

SEEN = []  # the batches the model's forward got


@attrs.frozen
class FindingConfig:
    image_size: tuple[int, int, int] = (8, 32, 32)
    declare: bool = True  # False: return the mask without declaring it
    shape: tuple[int, ...] = ()  # declare this shape instead of the true one


class WithFinding:
    """oct-standard's batch plus a uint8 finding mask [1, D, H, W]."""

    def __init__(self, config, ctx):
        from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build
        self.standard = build(OCTStandardConfig(image_size=config.image_size), ctx)
        self.config = config

    def __call__(self, sample, rng):
        out = self.standard(sample, rng)
        out["finding"] = (out["target"] > 0.5).astype(np.uint8)
        return out

    def batch_spec(self):
        spec = dict(self.standard.batch_spec())
        if self.config.declare:
            spec["finding"] = BatchKey(self.config.shape or (1, *self.config.image_size), "uint8")
        return spec


@attrs.frozen
class SegmenterConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)
    reads: tuple[str, ...] = ("context", "finding")


class Segmenter(torch.nn.Module):
    """Predicts the finding mask from the context view: a new method's model."""

    def __init__(self, config):
        super().__init__()
        self.inputs = tuple(config.reads)
        self.head = torch.nn.Conv3d(1, 1, 1)

    def forward(self, batch):
        SEEN.append({key: (tuple(t.shape), t.dtype, t.device.type) for key, t in batch.items()})
        logits = self.head(batch["context"])
        per_voxel = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, batch["finding"].float(), reduction="none")
        per_sample = per_voxel.flatten(1).mean(1)
        return ModelOutput(per_sample.mean(), per_sample, {})


@hookimpl
def octfw_register_transforms(register):
    register("with-finding", FindingConfig, lambda config, ctx: WithFinding(config, ctx), "views + mask")


@hookimpl
def octfw_register_models(register):
    register("segmenter", SegmenterConfig, lambda config, ctx: Segmenter(config), "finding masks")
'''

RECIPE = """
[run]
seed = 0
output_dir = "runs"
max_steps = 2
device = "cpu"

[engine]
per_device_batch = 2
log_every_steps = 1
num_workers = 1

[dataset]
name = "synthetic-oct"
n_volumes = 4

[transform]
name = "with-finding"

[model]
name = "segmenter"

[scheduler]
name = "constant"

[[logger]]
name = "jsonl"
"""


@pytest.fixture
def plugin(install_plugins):
    registry = install_plugins(plug_finding=PLUGIN)
    return sys.modules["plug_finding"], registry


def test_a_key_the_transform_declares_reaches_the_model_through_the_real_loader(plugin, write_recipe):
    from octfw.engine.trainer import train
    from octfw.runs.folder import create_run_dir

    module, registry = plugin
    recipe = load_recipe(write_recipe(RECIPE), [], registry)
    summary = train(recipe, registry, create_run_dir(recipe, registry))
    assert summary.update_steps == 2 and summary.last_loss is not None
    seen = module.SEEN[-1]
    # uint8 as declared (not a view, so never converted), batched, every other key beside it
    assert seen["finding"] == ((2, 1, 8, 32, 32), torch.uint8, "cpu")
    assert seen["context"][:2] == ((2, 1, 8, 32, 32), torch.float32)
    assert {"target", "context_idx", "target_idx", "domain_id"} <= set(seen)


def _items(registry, recipe_text, write_recipe, *overrides):
    recipe = load_recipe(write_recipe(recipe_text), list(overrides), registry)
    parts = build_components(recipe, registry, run_dir=None, with_loggers=False)
    source = SampleSource(parts.dataset, parts.transform, seed=0, domains=parts.domains)
    return [source[(0, i)] for i in range(2)], parts.transform.batch_spec()


def test_a_key_returned_but_not_declared_is_refused_naming_it(plugin, write_recipe):
    items, spec = _items(plugin[1], RECIPE, write_recipe, "transform.declare=false", "model.reads=['context']")
    with pytest.raises(ContractError, match=r"transform output does not match its batch_spec: "
                                            r"returns undeclared 'finding'"):
        collate(items, spec)


def test_a_declared_key_of_another_shape_is_refused_with_both_shapes(plugin, write_recipe):
    items, spec = _items(plugin[1], RECIPE, write_recipe, "transform.shape=[1, 8, 32, 16]")
    with pytest.raises(ContractError, match=r"'finding' has shape \[1, 8, 32, 32\] per sample; "
                                            r"its batch_spec declares \[1, 8, 32, 16\]"):
        collate(items, spec)


def test_a_model_reading_a_key_no_transform_makes_is_refused_at_build(plugin, write_recipe):
    with pytest.raises(UserError, match=r"\[model\] segmenter reads 'finding', which \[transform\] oct-standard "
                                        r"does not make \(it makes 'context', 'target', 'context_idx', 'target_idx'\)"):
        _items(plugin[1], RECIPE, write_recipe, 'transform={name="oct-standard", image_size=[8, 32, 32]}')


def test_octfw_check_refuses_the_mismatch_in_one_line_exit_2(tmp_path):
    """As a user meets it: an installed plugin, `octfw check`, no traceback."""
    make_dist(tmp_path, "octfw-finding", "plug_finding", PLUGIN)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE.replace('name = "with-finding"', 'name = "oct-standard"\nimage_size = [8, 32, 32]'))
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    env.pop(DISABLE_ENV, None)
    done = subprocess.run([sys.executable, "-m", "octfw.cli", "check", str(recipe)], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert lines == ["octfw: error: [model] segmenter reads 'finding', which [transform] oct-standard does not "
                     "make (it makes 'context', 'target', 'context_idx', 'target_idx')"], done.stderr
