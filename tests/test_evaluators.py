"""The evaluator stage: hook, probes, training-loss invariance, `octfw eval`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from octfw.cli import main
from octfw.evaluation.knn import knn_probabilities
from octfw.evaluation.probe import fit_linear_probe

from conftest import make_dist

EVALUATORS = """
[[evaluator]]
name = "linear-probe"
dataset = { name = "synthetic-oct", labels = true, n_volumes = 16, seed = 1 }

[[evaluator]]
name = "knn"
dataset = { name = "synthetic-oct", labels = true, n_volumes = 16, seed = 1 }
k = 3
"""

# An evaluator written in a test, registered through the hook like any plugin.
COUNTING_EVALUATOR = '''
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class CountConfig:
    every_steps: int = 2

class Count:
    def __init__(self, config):
        self.every_steps, self.calls = config.every_steps, 0
    def evaluate(self, model, device, update_step):
        import torch
        self.calls += 1
        volume = torch.zeros(1, 1, 8, 32, 32, device=device)
        return {"calls": float(self.calls), "embed_dim": float(model.embed(volume).shape[-1]),
                "grad_enabled": float(torch.is_grad_enabled())}

@hookimpl
def octfw_register_evaluators(register):
    register("count", CountConfig, lambda c, ctx: Count(c), "counts its calls")
'''


def _features(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    features = torch.randn(n, 16, generator=g)
    features[:, 0] += 4.0 * (2 * labels - 1)  # separable along one direction
    return features, labels


def test_linear_probe_separates_separable_features_and_stays_at_chance_on_shuffled_labels():
    train, train_y = _features(200, 0)
    test, test_y = _features(200, 1)
    probe = fit_linear_probe(train, train_y, 2)
    assert (probe.probabilities(test).argmax(1) == test_y).float().mean() > 0.97
    shuffled = train_y[torch.randperm(200, generator=torch.Generator().manual_seed(2))]
    chance = fit_linear_probe(train[:, 1:], shuffled, 2)  # no signal left
    accuracy = (chance.probabilities(test[:, 1:]).argmax(1) == test_y).float().mean()
    assert 0.35 < accuracy < 0.65


def test_knn_separates_separable_features():
    train, train_y = _features(100, 0)
    test, test_y = _features(100, 1)
    votes = knn_probabilities(train, train_y, test, 2, k=5)
    assert (votes.argmax(1) == test_y).float().mean() > 0.95


def test_evaluator_plugin_is_called_at_its_interval_without_gradients(tiny_recipe, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "octfw-count", "plug_count", COUNTING_EVALUATOR)
    monkeypatch.syspath_prepend(str(site))
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[evaluator]]\nname = "count"\n')
    assert main(["run", str(tiny_recipe)]) == 0
    run_dir = next((tmp_path / "runs" / "tiny").iterdir())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval/count/calls" in x]
    assert [(x["step"], x["eval/count/calls"]) for x in evals] == [(2, 1.0), (4, 2.0)]
    assert all(x["eval/count/grad_enabled"] == 0.0 and x["eval/count/embed_dim"] == 96.0 for x in evals)


def test_evaluation_does_not_change_training_losses(tiny_recipe, tmp_path):
    assert main(["run", str(tiny_recipe), "--set", f"run.output_dir={tmp_path / 'off'}"]) == 0
    tiny_recipe.write_text(tiny_recipe.read_text() + EVALUATORS.replace("n_volumes = 16", "n_volumes = 12"))
    assert main(["run", str(tiny_recipe), "--set", f"run.output_dir={tmp_path / 'on'}",
                 "--set", "evaluator.0.every_steps=1"]) == 0

    def losses(folder: Path) -> list[float]:
        run_dir = next((folder / "tiny").iterdir())
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [x["loss"] for x in lines if "loss" in x]

    assert losses(tmp_path / "on") == losses(tmp_path / "off")


def test_octfw_eval_compares_with_a_random_encoder(tiny_recipe, tmp_path, capsys):
    assert main(["run", str(tiny_recipe)]) == 0
    run_dir = next((tmp_path / "runs" / "tiny").iterdir())
    eval_recipe = tmp_path / "eval.toml"
    eval_recipe.write_text(EVALUATORS)
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--recipe", str(eval_recipe), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for column in ("pretrained", "random_init"):
        assert 0.0 <= report[column]["linear-probe/accuracy"] <= 1.0
        assert 0.0 <= report[column]["knn/accuracy"] <= 1.0
    assert report["update_step"] == 4


def test_octfw_eval_of_a_missing_source_is_a_user_error(tmp_path, capsys):
    eval_recipe = tmp_path / "eval.toml"
    eval_recipe.write_text(EVALUATORS)
    assert main(["eval", str(tmp_path / "nothing"), "--recipe", str(eval_recipe)]) == 2
    assert "Traceback" not in capsys.readouterr().err
