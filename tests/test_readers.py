"""What the frozen-feature readers see: the mean over a volume's tokens, the tokens themselves
(linear probe and kNN, ``reading``), and V-JEPA's attentive probe, on a finding a few tokens hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY_RECIPE
from octfw.display.errors import RecipeError, UserError
from octfw.evaluation.classification import Encoded
from octfw.evaluation.features import LabelledVolumes, extract_readings
from octfw.evaluation.shots import label_efficiency
from octfw.plugins.evaluators.knn import KNNConfig
from octfw.plugins.evaluators.knn.evaluator import KNNEvaluator
from octfw.plugins.evaluators.linear_probe import LinearProbeConfig
from octfw.plugins.evaluators.linear_probe.evaluator import LinearProbeEvaluator


def _volumes(labels) -> LabelledVolumes:
    n = len(labels)
    return LabelledVolumes(None, None, list(range(n)), np.asarray(labels, dtype=np.int64), ["a"] * n,
                           [f"v{i}" for i in range(n)], None)


def _evaluator(cls, config_cls, train_labels, test_labels, **options):
    evaluator = cls(config_cls(dataset={"name": "hand-made"}, **{"bootstrap": 0, **options}), None, None, None)
    evaluator._split = (_volumes(train_labels), _volumes(test_labels))  # what it would decode, given
    return evaluator


def _mean_free_finding(n: int, seed: int, tokens: int = 16, width: int = 8):
    """``[n, 1 + tokens, width]`` encodings (the mean, then the tokens) and labels 0/1: label 1
    raises channel 0 of one of the first four tokens and lowers it by as much in the token eight
    further on, so the mean over tokens is the same for both classes."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    x = torch.randn(n, tokens, width, generator=generator)
    where = torch.randint(0, 4, (n,), generator=generator)
    for i in range(n):
        if labels[i]:
            x[i, where[i], 0] += 3.0
            x[i, where[i] + 8, 0] -= 3.0
    return torch.cat([x.mean(dim=1, keepdim=True), x], dim=1), labels


@pytest.mark.parametrize("cls, config_cls, at_least", [(LinearProbeEvaluator, LinearProbeConfig, 0.75),
                                                       (KNNEvaluator, KNNConfig, 0.65)])
def test_the_token_reading_sees_a_finding_the_mean_washes_out_and_keeps_the_mean_under_its_old_names(
        cls, config_cls, at_least):
    train_x, train_y = _mean_free_finding(120, seed=0)
    test_x, test_y = _mean_free_finding(200, seed=1)
    evaluator = _evaluator(cls, config_cls, train_y.numpy(), test_y.numpy())  # reading = "both"
    metrics = evaluator.score(Encoded(train_x, test_x))
    assert metrics["tokens_balanced_accuracy"] >= at_least and metrics["tokens_auroc"] >= at_least
    assert metrics["balanced_accuracy"] <= 0.62  # the mean: chance is 0.5
    assert {"accuracy", "auroc", "auprc", "accuracy/a", "tokens_accuracy", "tokens_auprc",
            "tokens_accuracy/a"} <= set(metrics)


def test_one_reading_reports_its_own_names_only():
    train_x, train_y = _mean_free_finding(40, seed=0)
    test_x, test_y = _mean_free_finding(40, seed=1)
    encoded = Encoded(train_x, test_x)
    mean = _evaluator(LinearProbeEvaluator, LinearProbeConfig, train_y.numpy(), test_y.numpy(), reading="mean")
    tokens = _evaluator(LinearProbeEvaluator, LinearProbeConfig, train_y.numpy(), test_y.numpy(),
                        reading="tokens")
    assert not any(key.startswith("tokens_") for key in mean.score(encoded))
    assert all(key.startswith("tokens_") for key in tokens.score(encoded))
    both = _evaluator(LinearProbeEvaluator, LinearProbeConfig, train_y.numpy(), test_y.numpy())
    assert both.score(encoded) == {**mean.score(encoded), **tokens.score(encoded)}  # fitted separately


def test_the_paired_difference_and_the_shots_refits_carry_both_readings():
    train_x, train_y = _mean_free_finding(40, seed=0)
    test_x, test_y = _mean_free_finding(40, seed=1)
    evaluator = _evaluator(LinearProbeEvaluator, LinearProbeConfig, train_y.numpy(), test_y.numpy(), bootstrap=50)
    encoded = Encoded(train_x, test_x)
    evaluator.score(encoded)
    first = evaluator.last_test_probabilities
    evaluator.score(Encoded(train_x, test_x.flip(0)))
    difference = evaluator.difference(first, evaluator.last_test_probabilities)
    assert {"auroc", "auroc_ci_low", "tokens_auroc", "tokens_auroc_ci_high"} <= set(difference)
    ((_, runs),) = label_efficiency(evaluator, encoded, [5], draws=2, seed=0)  # octfw eval --shots
    assert all("tokens_auroc" in run and "auroc" in run for run in runs)


def test_reading_tokens_of_an_encoder_without_tokens_is_a_user_error_naming_the_reading():
    volumes = LabelledVolumes(None, None, [0, 1], np.array([0, 1]), ["a", "a"], ["v0", "v1"],
                              [np.zeros((1, 4, 4, 4), dtype=np.float32)] * 2)
    pooled_only = lambda batch: batch.flatten(1)  # [B, E]: no tokens
    with pytest.raises(UserError, match="reading = 'both'.*patch tokens"):
        extract_readings(pooled_only, volumes, "cpu", 2, grid=None, max_tokens=64, tokens=True,
                         where="evaluator linear-probe: reading = 'both'")
    assert extract_readings(pooled_only, volumes, "cpu", 2, grid=None, max_tokens=64, tokens=False,
                            where="").shape == (2, 1, 64)


def test_a_reading_that_does_not_exist_is_a_recipe_error_naming_its_key(write_recipe, registry):
    from octfw.recipe import load_recipe

    path = write_recipe(TINY_RECIPE + '\n[[evaluator]]\nname = "knn"\n'
                        'dataset = { name = "synthetic-oct", labels = true }\nreading = "token"\n')
    with pytest.raises(RecipeError, match=r"evaluator\[0\]\.reading"):
        load_recipe(path, (), registry)


def test_on_the_held_out_phantom_cysts_a_random_encoders_tokens_beat_their_mean(tmp_path, registry):
    """Issue #39 on real data: the cysts of the held-out phantom family sit in a few tokens. With
    a randomly initialised tiny encoder (the quickstart's, seed 0), the mean-pooled linear probe
    is near chance, while the linear probe on the tokens sees them (200 volumes, 100 patients, half
    of them test; benchmarks/learning/readers.py measures more)."""
    from octfw.recipe import build_component, load_recipe

    recipe = load_recipe("recipes/quickstart.toml", [f"run.cache_dir={str(tmp_path)!r}".replace("'", '"')],
                         registry)
    ctx = recipe.build_context(registry=registry)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = recipe.model.build(ctx).eval()
    dataset = {"name": "phantom-oct", "family": "held-out", "n_volumes": 200, "labels": True, "seed": 1}
    linear = build_component(registry, "evaluator", {"name": "linear-probe", "dataset": dataset, "bootstrap": 0},
                             ctx, "linear")
    attentive = build_component(registry, "evaluator", {
        "name": "attentive-probe", "dataset": dataset, "bootstrap": 0,
        "learning_rates": [1e-2, 3e-2, 0.1], "weight_decays": [0.1]}, ctx, "attentive")
    with torch.no_grad():
        read = linear.evaluate(model, torch.device("cpu"), 0)
        attended = attentive.evaluate(model, torch.device("cpu"), 0)
    assert read["balanced_accuracy"] <= 0.62
    assert read["tokens_balanced_accuracy"] >= read["balanced_accuracy"] + 0.3  # measured: 0.54 and 0.94
    # With standardised inputs the attentive probe chosen on 26 validation volumes does not reach the
    # token reading (measured 0.50 with this grid, 0.60 with the default one; docs/evaluation.md):
    # what holds is that validation, not the cap, stops it.
    assert attended["epochs_trained"] < 500
