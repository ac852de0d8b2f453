"""The evaluator stage: linear probe and kNN on frozen features, in the run and on demand."""

from __future__ import annotations

import csv
import importlib
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from octfw.cli.main import main
from octfw.engine.trainer import train
from octfw.display.errors import RecipeError, UserError
from octfw.evaluation.features import stratified_split
from octfw.plugins.evaluators.knn.algorithm import knn_probabilities
from octfw.evaluation.metrics import auroc, classification_metrics
from octfw.plugins.evaluators.linear_probe.algorithm import fit_linear_probe
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.runs.folder import create_run_dir

from conftest import TINY_RECIPE, make_dist

# A third-party evaluator, installed as a distribution: it records how the
# engine calls it and draws from the global torch generator, which the engine
# must restore so that training does not notice.
EATER_PLUGIN = '''
import attrs, torch
from octfw.hookspecs import hookimpl

CALLS = []

@attrs.frozen
class RngEaterConfig:
    every_steps: int | None = 2

class RngEater:
    def __init__(self, every_steps):
        self.every_steps = every_steps
    def evaluate(self, model, device, update_step):
        CALLS.append({"step": update_step, "grad_enabled": torch.is_grad_enabled()})
        torch.rand(1000)
        features = model.embed(torch.zeros(1, 1, 8, 32, 32, device=device))
        return {"step_seen": float(update_step), "tokens": float(features.shape[1])}

@hookimpl
def octfw_register_evaluators(register):
    register("rng-eater", RngEaterConfig, lambda config, ctx: RngEater(config.every_steps),
             "draws random numbers and records its calls")
'''

LABELLED = '{ name = "synthetic-oct", n_volumes = 12, labels = true, seed = 5 }'
PROBES = f"""
[[evaluator]]
name = "linear-probe"
every_steps = 1
dataset = {LABELLED}

[[evaluator]]
name = "knn"
every_steps = 2
dataset = {LABELLED}
k = 3
"""
EVAL_RECIPE = f"""
[run]
seed = 3
device = "cpu"

[[evaluator]]
name = "linear-probe"
dataset = {LABELLED}

[[evaluator]]
name = "knn"
dataset = {LABELLED}
k = 3
"""


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(path: Path) -> Path:
    registry = load_registry()
    recipe = load_recipe(path, (), registry)
    run_dir = create_run_dir(recipe, registry)
    train(recipe, registry, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def paired_runs(tmp_path_factory):
    """The tiny run without evaluation, and the same run with three evaluators at every step or two."""
    root = tmp_path_factory.mktemp("paired")
    site = root / "site"
    site.mkdir()
    make_dist(site, "octfw-rng-eater", "plug_rng_eater", EATER_PLUGIN)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        sys.modules.pop("plug_rng_eater", None)
        plugin = importlib.import_module("plug_rng_eater")
        plain = root / "plain.toml"
        plain.write_text(TINY_RECIPE, encoding="utf-8")
        evaluated = root / "evaluated.toml"
        evaluated.write_text(TINY_RECIPE + PROBES + '\n[[evaluator]]\nname = "rng-eater"\n', encoding="utf-8")
        runs = {"plain": _train(plain), "evaluated": _train(evaluated), "calls": list(plugin.CALLS)}
        sys.modules.pop("plug_rng_eater", None)
    return runs


# --- the classifiers and metrics -----------------------------------------------


def _blobs(n: int, seed: int, separation: float) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    direction = torch.zeros(32)
    direction[0] = separation
    features = torch.randn(n, 32, generator=generator) + labels[:, None] * direction + 5.0
    return features, labels


@pytest.mark.parametrize("classifier", ["linear-probe", "knn"])
def test_separable_features_are_classified_almost_perfectly_and_shuffled_labels_at_chance(classifier):
    def accuracy(train_x, train_y, test_x, test_y):
        if classifier == "linear-probe":
            probabilities = fit_linear_probe(train_x, train_y, 2).probabilities(test_x)
        else:
            probabilities = knn_probabilities(train_x, train_y, test_x, 2, k=10)
        return float((probabilities.argmax(1) == test_y).float().mean())

    train_x, train_y = _blobs(200, seed=0, separation=8.0)
    test_x, test_y = _blobs(400, seed=1, separation=8.0)
    assert accuracy(train_x, train_y, test_x, test_y) >= 0.98

    shuffled = train_y[torch.randperm(200, generator=torch.Generator().manual_seed(2))]
    chance = [accuracy(train_x, shuffled, test_x, test_y)]
    chance += [accuracy(train_x, train_y[torch.randperm(200, generator=torch.Generator().manual_seed(s))],
                        test_x, test_y) for s in (3, 4)]
    assert 0.4 <= float(np.mean(chance)) <= 0.6


def test_the_probe_is_deterministic_and_independent_of_the_global_generator():
    x, y = _blobs(64, seed=0, separation=1.0)
    torch.manual_seed(0)
    first = fit_linear_probe(x, y, 2)
    torch.manual_seed(123)
    torch.rand(10)
    second = fit_linear_probe(x, y, 2)
    assert torch.equal(first.weight, second.weight) and torch.equal(first.bias, second.bias)


def test_the_probe_fits_under_no_grad_as_the_engine_calls_it():
    x, y = _blobs(100, seed=0, separation=8.0)
    with torch.no_grad():
        probe = fit_linear_probe(x, y, 2)
    assert float((probe.probabilities(x).argmax(1) == y).float().mean()) == 1.0


def test_auroc_counts_ties_half_and_is_left_out_for_one_class():
    assert auroc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert auroc(np.array([0, 1]), np.array([0.5, 0.5])) == 0.5
    metrics = classification_metrics(
        np.array([0, 1, 1, 1]), np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]]),
        np.array([0, 1]), ["a", "a", "b", "b"])
    assert metrics["accuracy"] == 0.75 and metrics["balanced_accuracy"] == pytest.approx((1.0 + 2 / 3) / 2)
    assert metrics["accuracy/b"] == 0.5 and "auroc/a" in metrics and "auroc/b" not in metrics


def test_the_split_is_stratified_disjoint_and_seeded():
    labels = np.array([0, 1] * 12)
    domains = ["a", "a", "b", "b", "c", "c"] * 4
    train, test = stratified_split(labels, domains, 0.5, seed=7)
    assert sorted(train + test) == list(range(24)) and not set(train) & set(test)
    for domain in "abc":
        for label in (0, 1):
            stratum = [i for i in range(24) if domains[i] == domain and labels[i] == label]
            assert len(set(stratum) & set(train)) == len(set(stratum) & set(test)) == 2
    assert stratified_split(labels, domains, 0.5, seed=7) == (train, test)
    assert stratified_split(labels, domains, 0.5, seed=8) != (train, test)


# --- recipes -----------------------------------------------------------------------


def test_a_nested_dataset_table_is_validated_with_its_key(write_recipe, registry):
    path = write_recipe(TINY_RECIPE + '\n[[evaluator]]\nname = "knn"\nk = 0\n'
                        'dataset = { name = "synthetic-oct", n_volumz = 3 }\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(path, (), registry)
    problems = "\n".join(info.value.problems)
    assert "evaluator[0].dataset: n_volumz: unknown key (did you mean 'n_volumes'?)" in problems
    assert "evaluator[0].k: must be > 0" in problems


def test_nested_tables_are_stored_resolved_as_plain_data(write_recipe, registry, tmp_path):
    path = write_recipe(TINY_RECIPE + '\n[[evaluator]]\nname = "knn"\n'
                        'dataset = { name = "dicom", path = "labels/manifest.csv" }\n')
    recipe = load_recipe(path, (), registry)
    table = recipe.to_dict()["evaluator"][0]["dataset"]
    assert table["path"] == str(tmp_path / "labels" / "manifest.csv") and type(table["path"]) is str
    assert table["domain_from"] == "header"  # the default, filled in


def test_a_dataset_without_labels_is_refused_before_training(write_recipe, registry):
    path = write_recipe(TINY_RECIPE + '\n[[evaluator]]\nname = "linear-probe"\n'
                        'dataset = { name = "synthetic-oct", n_volumes = 4 }\n')
    from octfw.engine.build import build_components

    recipe = load_recipe(path, (), registry)
    with pytest.raises(UserError, match="evaluator linear-probe: dataset: 4 of 4 volumes have no label"):
        build_components(recipe, registry, run_dir=None)


# --- in the run ------------------------------------------------------------------


def test_evaluation_leaves_the_training_losses_bitwise_unchanged(paired_runs):
    plain = [m["loss"] for m in _metrics(paired_runs["plain"]) if "loss" in m]
    evaluated = [m["loss"] for m in _metrics(paired_runs["evaluated"]) if "loss" in m]
    assert len(plain) == 4 and plain == evaluated
    # The rng-eater drew from the global generator: the state saved at the end is the same anyway.
    def final_rng(run_dir: Path) -> torch.Tensor:
        state = torch.load(run_dir / "checkpoints" / "step_00000004.pt", weights_only=True)
        return state["rng"]["torch"]

    assert torch.equal(final_rng(paired_runs["plain"]), final_rng(paired_runs["evaluated"]))


def test_a_plugin_evaluator_is_called_at_its_interval_and_the_end_without_gradients(paired_runs):
    assert paired_runs["calls"] == [{"step": 2, "grad_enabled": False}, {"step": 4, "grad_enabled": False}]
    logged = [m for m in _metrics(paired_runs["evaluated"]) if "eval/rng-eater/step_seen" in m]
    assert [m["eval/rng-eater/step_seen"] for m in logged] == [2.0, 4.0]
    assert all(m["eval/rng-eater/tokens"] == 8.0 for m in logged)


def test_probe_results_are_logged_overall_and_per_domain(paired_runs):
    records = _metrics(paired_runs["evaluated"])
    probe_steps = [m["step"] for m in records if "eval/linear-probe/accuracy" in m]
    knn_steps = [m["step"] for m in records if "eval/knn/accuracy" in m]
    assert probe_steps == [1, 2, 3, 4] and knn_steps == [2, 4]
    last = [m for m in records if "eval/knn/accuracy" in m][-1]
    for name in ("linear-probe", "knn"):
        for key in ("accuracy", "balanced_accuracy", *(f"accuracy/{d}" for d in ("heidelberg", "topcon", "zeiss"))):
            assert 0.0 <= last[f"eval/{name}/{key}"] <= 1.0


# --- on demand -------------------------------------------------------------------


def _eval_json(capsys, source: Path, recipe: Path) -> dict:
    assert main(["eval", str(source), "--recipe", str(recipe), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_octfw_eval_compares_a_checkpoint_with_a_seeded_random_encoder(paired_runs, tmp_path, capsys):
    recipe = tmp_path / "eval.toml"
    recipe.write_text(textwrap.dedent(EVAL_RECIPE), encoding="utf-8")
    report = _eval_json(capsys, paired_runs["plain"], recipe)
    assert report["update_step"] == 4 and report["seed"] == 3
    assert set(report["pretrained"]) == set(report["random_init"])
    assert {"linear-probe/accuracy", "linear-probe/auroc", "knn/balanced_accuracy",
            "knn/accuracy/zeiss"} <= set(report["pretrained"])
    assert _eval_json(capsys, paired_runs["plain"], recipe) == report  # deterministic, baseline included

    # The exported target encoder gives the same features, hence the same scores.
    from octfw.exports.export import export_encoder

    encoder = tmp_path / "encoder.pt"
    export_encoder(paired_runs["plain"], encoder, load_registry())
    exported = _eval_json(capsys, encoder, recipe)
    assert exported["pretrained"] == report["pretrained"]

    assert main(["eval", str(paired_runs["plain"]), "--recipe", str(recipe)]) == 0
    table = capsys.readouterr().out
    assert "random init" in table and "knn/accuracy/heidelberg" in table
    row = next(line.split() for line in table.splitlines() if line.startswith("knn/accuracy "))
    assert float(row[3]) == pytest.approx(float(row[1]) - float(row[2]), abs=1.5e-3)  # the difference column

    # Evaluating a run folder keeps the results in it: the JSON and the table printed.
    kept = paired_runs["plain"] / "eval" / f"target-{recipe.stem}"
    assert json.loads(kept.with_suffix(".json").read_text())["pretrained"] == report["pretrained"]
    assert kept.with_suffix(".txt").read_text().strip() == table.split("\neval_json ")[0].strip()
    with kept.with_suffix(".csv").open(newline="") as f:  # and a CSV pandas.read_csv opens
        rows = {row["metric"]: row for row in csv.DictReader(f)}
    assert float(rows["knn/auroc"]["pretrained"]) == report["pretrained"]["knn/auroc"]
    assert float(rows["knn/auroc"]["random_init_ci_low"]) == report["random_init"]["knn/auroc_ci_low"]
    assert float(rows["knn/auroc"]["difference_ci_high"]) == report["difference"]["knn/auroc_ci_high"]
    assert float(rows["knn/accuracy"]["difference"]) == pytest.approx(
        report["pretrained"]["knn/accuracy"] - report["random_init"]["knn/accuracy"])


def test_octfw_eval_reports_every_recipe_problem(tmp_path, capsys):
    recipe = tmp_path / "eval.toml"
    recipe.write_text('[run]\nsed = 1\n[[evaluator]]\nname = "knnn"\n', encoding="utf-8")
    assert main(["eval", str(tmp_path), "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "run.sed: unknown key (did you mean 'seed'?)" in err
    assert "evaluator[0].name: unknown evaluator component 'knnn' (did you mean 'knn'?)" in err


def test_octfw_eval_of_a_missing_source_is_a_user_error(tmp_path, capsys):
    recipe = tmp_path / "eval.toml"
    recipe.write_text(textwrap.dedent(EVAL_RECIPE), encoding="utf-8")
    assert main(["eval", str(tmp_path / "nothing"), "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "nothing" in err and "Traceback" not in err
