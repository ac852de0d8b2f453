"""The fine-tune evaluator: layer-wise learning rates, a private copy, the epoch chosen on validation.

Encoders here are tiny ViT3D encoders built directly (width 24, depth 2 or 3,
8 x 32 x 32 volumes in 4 x 16 x 16 patches: 8 tokens), and the easy task is
made by hand: class 1 is bright in one corner of the volume, class 0 dark.
"""

from __future__ import annotations

import math

import csv
import json
import textwrap

import numpy as np
import pytest
import torch

from conftest import TINY_RECIPE, run_xla_script
from octfw.cli.main import main
from octfw.display.errors import RecipeError
from octfw.evaluation.classification import Encoded
from octfw.plugins.evaluators.fine_tune.evaluator import FineTuneEvaluator
from octfw.plugins.evaluators.fine_tune import FineTuneConfig
from octfw.evaluation.features import LabelledVolumes
from octfw.evaluation.attentive import layout
from octfw.evaluation.fine_tuning import parameter_groups
from octfw.plugins.evaluators.fine_tune.algorithm import FineTuneNetwork, fine_tune, frozen_prefix
from octfw.exports.formats import encoder_info
from octfw.exports.writing import write_export
from octfw.models.vit3d import ViT3DEncoder
from octfw.recipe import load_recipe


IMAGE, PATCH = (8, 32, 32), (4, 16, 16)


def _encoder(depth: int = 2, seed: int = 0) -> ViT3DEncoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ViT3DEncoder(IMAGE, PATCH, 1, 24, depth, 2, 2.0)


def _corners(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 1, 8, 32, 32]`` noisy volumes and alternating labels: one corner is bright (1) or dark (0)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    volumes = torch.randn(n, 1, *IMAGE, generator=generator) * 0.5
    volumes[:, :, :4, :16, :16] += (labels * 2.0 - 1.0)[:, None, None, None, None]
    return volumes, labels


def _evaluator(train_labels, test_labels, train_x=None, test_x=None, **options) -> FineTuneEvaluator:
    config = FineTuneConfig(dataset={"name": "hand-made"}, bootstrap=0, **options)
    evaluator = FineTuneEvaluator(config, None, None, None)

    def volumes(labels, prepared):
        n = len(labels)
        return LabelledVolumes(None, None, list(range(n)), np.asarray(labels, dtype=np.int64), ["a"] * n,
                               [f"v{i}" for i in range(n)], None if prepared is None else list(prepared.numpy()))

    # What it would decode and split from a dataset, given directly.
    evaluator._split = (volumes(train_labels, train_x), volumes(test_labels, test_x))
    return evaluator


def _encoded(encoder, blocks, train_x, test_x) -> Encoded:
    with torch.no_grad():
        return Encoded(frozen_prefix(encoder, blocks, train_x), frozen_prefix(encoder, blocks, test_x),
                       network=encoder)


# --- the optimizer ---------------------------------------------------------------


def test_each_layer_gets_its_decayed_learning_rate_and_only_matrices_are_decayed():
    depth, lr, decay = 3, 1e-3, 0.5
    network = FineTuneNetwork(_encoder(depth), "all", n_classes=2, num_heads=2, generator=torch.Generator())
    groups = parameter_groups(network, lr, decay, weight_decay=0.05)
    expected = {"encoder.patch_embed.proj.weight": depth + 1, "encoder.blocks.0.attn.qkv.weight": 3,
                "encoder.blocks.1.mlp.fc1.bias": 2, "encoder.blocks.2.norm1.weight": 1,
                "encoder.norm.weight": 0, "head.params.b_c": 0, "head.params.w_c": 0,
                "head.params.query": 0, "head.params.w_k": 0}
    seen = {}
    for group in groups:
        assert group["lr"] == pytest.approx(lr * decay ** group["exponent"])
        for name, param in zip(group["names"], group["params"]):
            seen[name] = group["exponent"]
            assert group["weight_decay"] == (0.05 if param.ndim > 1 else 0.0), name
    assert {name: seen[name] for name in expected} == expected
    assert len(seen) == len(list(network.parameters()))  # "all": every parameter trains


def test_the_last_k_blocks_train_and_the_rest_is_frozen_and_left_out_of_the_optimizer():
    network = FineTuneNetwork(_encoder(depth=3), 1, n_classes=2, num_heads=2, generator=torch.Generator())
    grouped = {name for group in parameter_groups(network, 1e-3, 0.75, 0.05) for name in group["names"]}
    trainable = {name for name, p in network.named_parameters() if p.requires_grad}
    assert grouped == trainable
    assert all(name.startswith(("encoder.blocks.2.", "encoder.norm.", "head."))
               for name in trainable)
    assert any(name.startswith("encoder.blocks.2.") for name in trainable)
    frozen = [p for name, p in network.named_parameters()
              if name.startswith(("encoder.patch_embed.", "encoder.blocks.0.", "encoder.blocks.1."))]
    assert frozen and not any(p.requires_grad for p in frozen)


# --- the fit ---------------------------------------------------------------------


def test_fine_tuning_from_random_init_learns_an_easy_task_and_leaves_the_callers_encoder_alone():
    encoder = _encoder()
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    train_x, train_y = _corners(32, seed=0)
    test_x, test_y = _corners(40, seed=1)
    evaluator = _evaluator(train_y.numpy(), test_y.numpy(), epochs=8)
    with torch.no_grad():  # as the engine calls evaluators
        metrics = evaluator.score(_encoded(encoder, "all", train_x, test_x))
    assert metrics["balanced_accuracy"] >= 0.85 and metrics["auroc"] >= 0.9  # chance: 0.5
    assert 0 <= metrics["selected_epoch"] <= 8 and metrics["val_balanced_accuracy"] >= 0.75
    head = sum(math.prod(shape) for shape in layout(24, 2).values())  # V-JEPA's attentive head
    assert metrics["trained_parameters"] == sum(p.numel() for p in encoder.parameters()) + head
    assert all(torch.equal(before[k], v) for k, v in encoder.state_dict().items())
    assert [p.requires_grad for p in encoder.parameters()] == [p.requires_grad for p in _encoder().parameters()]


def test_a_fit_is_deterministic_for_a_seed_whatever_the_global_generator():
    encoder = _encoder()
    train_x, train_y = _corners(16, seed=0)
    test_x, _ = _corners(10, seed=1)
    with torch.no_grad():  # the last block trains: its inputs are the first block's tokens
        train_x, test_x = frozen_prefix(encoder, 1, train_x), frozen_prefix(encoder, 1, test_x)
    options = dict(blocks=1, epochs=3, head_epochs=5, batch_size=4, lr=3e-3, seed=5)
    val_x, val_y = train_x[:6], train_y[:6]
    torch.manual_seed(1)
    first = fine_tune(encoder, train_x, train_y, val_x, val_y, test_x, 2, **options).test_probabilities
    torch.manual_seed(2)
    torch.rand(7)
    second = fine_tune(encoder, train_x, train_y, val_x, val_y, test_x, 2, **options).test_probabilities
    assert torch.equal(first, second)
    other = fine_tune(encoder, train_x, train_y, val_x, val_y, test_x, 2, **{**options, "seed": 6})
    assert not torch.equal(first, other.test_probabilities)


def test_the_evaluator_encodes_a_snapshot_and_caches_the_frozen_blocks():
    encoder = _encoder(depth=2)
    (train_x, train_y), (test_x, test_y) = _corners(8, seed=0), _corners(4, seed=1)
    evaluator = _evaluator(train_y.numpy(), test_y.numpy(), train_x, test_x, blocks=1, batch_size=3)
    encoded = evaluator.encode(encoder, torch.device("cpu"))
    assert encoded.train.shape == (8, 8, 24) and encoded.test.shape == (4, 8, 24)  # tokens, not volumes
    with torch.no_grad():
        expected = encoder.levels(train_x, depths=(1,))[0]  # the tokens after the first (frozen) block
    assert torch.allclose(encoded.train, expected, atol=1e-6)
    assert encoded.network is not encoder
    with torch.no_grad():  # a snapshot: training the caller's encoder on does not reach it
        encoder.norm.weight.add_(1.0)
    assert not torch.equal(encoded.network.norm.weight, encoder.norm.weight)

    whole = _evaluator(train_y.numpy(), test_y.numpy(), train_x, test_x, blocks="all").encode(encoder, "cpu")
    assert torch.equal(whole.train, train_x)  # the whole encoder trains: its input is the volume


@pytest.mark.parametrize("position", ["sincos", "rope"])
@pytest.mark.parametrize("blocks", ["all", 1])
def test_a_fine_tuned_encoder_starts_as_the_encoder_it_copies(position, blocks):
    """Fine-tuning runs the encoder in pieces through its own input step: a standardising encoder
    standardises, a rotary one rotates; before any update the network's tokens are the encoder's
    (they were not: the evaluators added `pos_embed` to the raw patches themselves)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        encoder = ViT3DEncoder(IMAGE, PATCH, 1, 24, 2, 2, 2.0, standardise_input=True, position=position).eval()
    volumes = _corners(3, seed=2)[0] * 40.0 + 7.0  # far from standardised
    network = FineTuneNetwork(encoder, blocks, 2, 2, torch.Generator().manual_seed(0)).eval()
    with torch.no_grad():
        tokens = network.tokens(frozen_prefix(encoder, blocks, volumes))
        assert torch.allclose(tokens, encoder(volumes), atol=1e-5)


# --- recipes and the command -----------------------------------------------------


@pytest.mark.parametrize("option, message", [("layer_decay = 0", "evaluator[0].layer_decay: must be in (0.0, 1.0]"),
                                             ("blocks = 0", "evaluator[0].blocks: must be 'all' or a number"),
                                             ('blocks = "last"', "evaluator[0].blocks:")])
def test_a_bad_option_is_a_recipe_error_naming_its_key(write_recipe, registry, option, message):
    path = write_recipe(TINY_RECIPE + '\n[[evaluator]]\nname = "fine-tune"\n'
                        f'dataset = {{ name = "synthetic-oct", labels = true }}\n{option}\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(path, (), registry)
    assert len(info.value.problems) == 1 and message in info.value.problems[0]


def test_shots_run_with_the_fine_tune_evaluator_and_write_its_rows(tmp_path, capsys):
    encoder = _encoder()
    recipe = {"transform": {"name": "oct-standard", "image_size": list(IMAGE)}, "model": {"name": "vjepa3d"}}
    export = tmp_path / "encoder.pt"
    write_export("octfw", export, encoder, encoder_info(encoder.architecture(), recipe, "hand-made", 0, {}))
    eval_recipe = tmp_path / "eval.toml"
    eval_recipe.write_text(textwrap.dedent("""
        [run]
        device = "cpu"

        [[evaluator]]
        name = "fine-tune"
        dataset = { name = "synthetic-oct", n_volumes = 24, labels = true, seed = 5 }
        blocks = 1
        epochs = 2
        head_epochs = 5
        bootstrap = 50
    """), encoding="utf-8")
    png = tmp_path / "shots.png"
    assert main(["eval", str(export), "--recipe", str(eval_recipe), "--shots", "2,all", "--draws", "1",
                 "--png", str(png), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["csv"] == str(png.with_suffix(".csv"))
    with png.with_suffix(".csv").open(encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["metric"] in ("auroc", "selected_epoch")]
    assert {(r["encoder"], r["evaluator"], r["shots"], r["metric"]) for r in rows} == {
        (e, "fine-tune", s, m) for e in ("pretrained", "random_init") for s in ("2", "all")
        for m in ("auroc", "selected_epoch")}


def test_a_fit_that_only_ever_answers_one_class_says_so():
    # Inputs without any signal and three labels of 0 to one of 1: at every epoch the network
    # answers the prior, class 0, for every validation volume.
    encoder = _encoder()
    with torch.no_grad():
        tokens = frozen_prefix(encoder, 1, torch.zeros(16, 1, *IMAGE))
    labels = torch.tensor([0, 0, 0, 1] * 4)
    result = fine_tune(encoder, tokens, labels, tokens[:8], labels[:8], tokens[:4], 2, blocks=1, epochs=3,
                       head_epochs=5, batch_size=4, lr=1e-3)
    assert result.single_class
    assert (result.test_probabilities.argmax(dim=1) == 0).all()


def _corner_tokens():
    """A random encoder and the corners task as the tokens its last block reads (``blocks = 1``):
    32 fit volumes (the first 8 also validate) and 40 test volumes."""
    encoder = _encoder()
    (train_x, train_y), (test_x, test_y) = _corners(32, seed=0), _corners(40, seed=1)
    with torch.no_grad():
        return encoder, (frozen_prefix(encoder, 1, train_x), train_y), (frozen_prefix(encoder, 1, test_x), test_y)


def test_a_head_fitted_first_reads_what_a_fresh_head_cannot_in_the_same_fine_tuning():
    # Fine-tuning too short and too slow to train a fresh attentive head (one epoch at lr 1e-6)
    # answers one class; the head fitted on the frozen tokens first (LP-FT) reads the corners.
    encoder, (train_x, train_y), (test_x, test_y) = _corner_tokens()
    options = dict(blocks=1, epochs=1, batch_size=4, lr=1e-6, num_heads=2)
    fresh = fine_tune(encoder, train_x, train_y, train_x[:8], train_y[:8], test_x, 2, head_epochs=0, **options)
    fitted = fine_tune(encoder, train_x, train_y, train_x[:8], train_y[:8], test_x, 2, head_epochs=60, **options)
    accuracy = [float((r.test_probabilities.argmax(dim=1) == test_y).float().mean()) for r in (fresh, fitted)]
    assert fresh.single_class and accuracy[0] <= 0.5  # one class for every volume
    assert not fitted.single_class and accuracy[1] >= 0.9


def test_the_fitted_head_alone_is_kept_when_every_fine_tuning_epoch_is_worse():
    # A learning rate that wrecks the network: validation keeps the head on the starting
    # encoder (selected_epoch 0), which predicts as a fit that never updates the encoder.
    encoder, (train_x, train_y), (test_x, test_y) = _corner_tokens()
    options = dict(blocks=1, batch_size=4, num_heads=2, head_epochs=60)
    result = fine_tune(encoder, train_x, train_y, train_x[:8], train_y[:8], test_x, 2, epochs=2, lr=1e3, **options)
    head_only = fine_tune(encoder, train_x, train_y, train_x[:8], train_y[:8], test_x, 2, epochs=1, lr=0.0, **options)
    assert result.selected_epoch == 0 and result.val_balanced_accuracy == 1.0
    assert torch.allclose(result.test_probabilities, head_only.test_probabilities, atol=1e-6)
    assert float((result.test_probabilities.argmax(dim=1) == test_y).float().mean()) >= 0.9



def test_a_fit_with_its_head_phase_runs_on_an_xla_device_as_on_the_cpu():
    # torch_xla's CPU device, in a subprocess (importing torch_xla patches torch for the process,
    # and autograd must meet the XLA device before any CPU backward): both phases train there
    # (fixed-shape steps, a sync each) and give the CPU's result up to float rounding.
    result = run_xla_script("fine_tune_fit.py")
    assert result["device"] == "xla"
    assert result["selected_epoch"]["xla"] == result["selected_epoch"]["cpu"]
    assert result["max_difference"] < 1e-3
