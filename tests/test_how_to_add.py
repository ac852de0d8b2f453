"""docs/architecture.md, "How to add ...": each recipe there, done here as a third party would.

Each example is a plugin module in the docs' shape (a config, the code, a ``build`` and the
``@hookimpl`` that registers it), loaded through an entry point as an installed package's
would be, and used by the real engine. If a section of the guide stops being enough to
write its example, the test here fails.
"""

from __future__ import annotations

from octfw.recipe import load_recipe

from conftest import TINY_RECIPE

# --- a method: a second objective on the shared encoder ------------------------------------

METHOD = '''
import attrs
import torch
from octfw.hookspecs import hookimpl
from octfw.models.vit3d import ViT3DEncoder
from octfw.types import ModelOutput


@attrs.frozen
class AgreementConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)
    embed_dim: int = 32


class ViewAgreement(torch.nn.Module):
    """Pulls the mean token of the context view towards the (stopped) target view's."""

    inputs = ("context", "target")

    def __init__(self, config, ctx):
        super().__init__()
        self.encoder = ViT3DEncoder(ctx.image_size, config.patch_size, in_channels=1,
                                    embed_dim=config.embed_dim, depth=2, num_heads=2, mlp_ratio=2.0)

    def forward(self, batch):
        online = self.encoder(batch["context"]).mean(1)
        with torch.no_grad():
            target = self.encoder(batch["target"]).mean(1)
        per_sample = 1 - torch.nn.functional.cosine_similarity(online, target, dim=-1)
        return ModelOutput(per_sample.mean(), per_sample, {"token_std": online.std(0).mean().detach()})


@hookimpl
def octfw_register_models(register):
    register("view-agreement", AgreementConfig, lambda config, ctx: ViewAgreement(config, ctx),
             "mean-token agreement between two views")
'''

# --- a checkpoint backend: any fsspec URL --------------------------------------------------

BACKEND = '''
import attrs
from octfw.hookspecs import hookimpl
from octfw.storage.checkpointer import StoredCheckpointer
from octfw.storage.checkpoints import CheckpointStorage


@attrs.frozen
class MemoryCheckpointConfig:
    dir: str = "memory://checkpoints"
    keep_last: int = 2


def build(config, ctx):
    storage = CheckpointStorage(config.dir, keep_last=config.keep_last, setting="checkpointer.dir")
    return StoredCheckpointer(storage, rank=ctx.rank)


@hookimpl
def octfw_register_checkpointers(register):
    register("in-memory", MemoryCheckpointConfig, build, "checkpoints in fsspec's memory filesystem")
'''

# --- an evaluator: a dense (per-patch) reading of the encoder --------------------------------

EVALUATOR = '''
import attrs
import numpy as np
import torch
from octfw.hookspecs import hookimpl
from octfw.recipe import build_component


@attrs.frozen
class BrightPatchesConfig:
    every_steps: int | None = None
    volumes: int = 6


class BrightPatches:
    """Dice of a per-patch linear probe finding the brighter half of the patches of a volume,
    fitted on half the volumes, scored on the others: a dense evaluator's skeleton."""

    def __init__(self, config, ctx):
        self.every_steps, self.volumes = config.every_steps, config.volumes
        # Components of its own, built from recipe-style tables as the recipe's are.
        self.dataset = build_component(ctx.registry, "dataset", {"name": "synthetic-oct", "n_volumes": config.volumes},
                                       ctx, "evaluator bright-patches")
        self.transform = build_component(ctx.registry, "transform",
                                         {"name": "oct-standard", "image_size": list(ctx.image_size)},
                                         ctx, "evaluator bright-patches")

    def evaluate(self, model, device, update_step):
        tokens, targets = [], []
        for index in range(self.volumes):
            view = torch.from_numpy(self.transform.prepare(self.dataset.load(index)))[None, None].to(device)
            patches = torch.nn.functional.avg_pool3d(view, model.encoder.patch_size).flatten(1)  # [1, N]
            tokens.append(model.encoder(view)[0].float().cpu())
            targets.append((patches[0] > patches[0].median()).float().cpu())
        half = self.volumes // 2
        x, y = torch.cat(tokens[:half]), torch.cat(targets[:half])
        weights = torch.linalg.lstsq(torch.cat([x, torch.ones(len(x), 1)], 1), y[:, None]).solution
        test_x, test_y = torch.cat(tokens[half:]), torch.cat(targets[half:])
        predicted = (torch.cat([test_x, torch.ones(len(test_x), 1)], 1) @ weights)[:, 0] > 0.5
        overlap = float((predicted & test_y.bool()).sum())
        dice = 2 * overlap / max(float(predicted.sum() + test_y.sum()), 1.0)
        return {"dice": dice}


@hookimpl
def octfw_register_evaluators(register):
    register("bright-patches", BrightPatchesConfig, lambda config, ctx: BrightPatches(config, ctx),
             "per-patch probe of the brighter patches (Dice)")
'''

#: The tests' tiny recipe, checkpointing every 2 of its 4 update steps.
RECIPE = TINY_RECIPE.replace("log_every_steps = 1", "log_every_steps = 2\ncheckpoint_every_steps = 2")


def _train(registry, recipe_path, *overrides, resume=None):
    from octfw.engine.trainer import train
    from octfw.runs.folder import create_run_dir

    recipe = load_recipe(recipe_path, list(overrides), registry)
    return train(recipe, registry, create_run_dir(recipe, registry), resume=resume)


def test_a_method_is_a_model_plugin_on_the_shared_encoder(install_plugins, write_recipe):
    registry = install_plugins(plug_method=METHOD)
    summary = _train(registry, write_recipe(RECIPE), 'model={name="view-agreement"}')
    assert summary.update_steps == 4 and summary.checkpoint is not None
    assert summary.first_loss is not None and summary.last_loss is not None


def test_a_checkpoint_backend_is_a_storage_url_and_a_build(install_plugins, write_recipe):
    """fsspec's memory filesystem standing in for s3:// or az://: save, then resume from it."""
    import fsspec

    url = "memory://octfw-how-to-add/checkpoints"
    registry = install_plugins(plug_backend=BACKEND)
    recipe = write_recipe(RECIPE)
    table = f'checkpointer={{name="in-memory", dir="{url}"}}'
    first = _train(registry, recipe, table)
    memory = fsspec.filesystem("memory")
    assert first.checkpoint == f"{url}/step_00000004.pt" and memory.exists(first.checkpoint)
    resumed = _train(registry, recipe, table, resume=f"{url}/step_00000002.pt")  # the older one kept
    assert resumed.update_steps == 4 and resumed.first_loss == first.first_loss


def test_an_evaluator_is_an_evaluate_method_and_a_build(install_plugins, write_recipe):
    registry = install_plugins(plug_evaluator=EVALUATOR)
    summary = _train(registry, write_recipe(RECIPE + '\n[[evaluator]]\nname = "bright-patches"\n'))
    assert summary.update_steps == 4
    import json

    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    dice = [row[key] for row in rows for key in row if key.endswith("dice")]
    assert dice and 0.0 <= dice[-1] <= 1.0
