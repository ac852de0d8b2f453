"""``octfw eval``'s reports a user can cite (issue 61): ``--shots`` with a row per draw, paired
differences from random init with patient-bootstrap intervals, one random baseline fitted once per
draw for every encoder named side by side, the test split stated, boundary errors stated with
their row spacing, progress shown during every fit, help texts true for segmentation.

The classifier here is the real kNN evaluator on encodings given by hand (its ``encode`` returns
the "encoder"'s fixed features), so a whole ``--shots`` evaluation takes a fraction of a second.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from octfw.evaluation import label_efficiency
from octfw.evaluation.classification import Encoded
from octfw.evaluation.features import LabelledVolumes
from octfw.evaluation.label_efficiency import RANDOM_INIT, ShotsReport, evaluate_shots, format_shots
from octfw.evaluation.metrics import paired_difference
from octfw.evaluation.reporting import boundary_legend, format_test_split, interval_keys
from octfw.evaluation.target import Counter, EvalTarget
from octfw.plugins.evaluators.knn import KNNConfig
from octfw.plugins.evaluators.knn.evaluator import KNNEvaluator

N_TRAIN, N_TEST = 24, 24


TRAIN_LABELS = np.arange(N_TRAIN) % 2
TEST_LABELS = np.repeat(np.arange(N_TEST // 2) % 2, 2)  # in pairs: one patient's two scans


def _volumes(labels: np.ndarray, groups: list[str] | None) -> LabelledVolumes:
    n = len(labels)
    return LabelledVolumes(None, None, list(range(n)), labels, ["a"] * n, [f"v{i}" for i in range(n)], None, groups)


def _features(seed: int, signal: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) encodings ``[N, 1, 8]`` (the mean reading only): the label moves channel 0 by
    ``signal``. The test volumes come in pairs, one patient's two scans of one eye: equal."""
    generator = torch.Generator().manual_seed(seed)
    train = torch.randn(N_TRAIN, 1, 8, generator=generator)
    train[:, 0, 0] += signal * torch.from_numpy(TRAIN_LABELS)
    half = torch.randn(N_TEST // 2, 1, 8, generator=generator)
    half[:, 0, 0] += signal * torch.from_numpy(TEST_LABELS[0::2])
    return train, half.repeat_interleave(2, dim=0)


class Encoder(torch.nn.Module):
    """An encoder whose encodings are given (its train and test features)."""

    def __init__(self, name: str, seed: int, signal: float):
        super().__init__()
        self.name = name
        train, test = _features(seed, signal)
        self.register_buffer("train_features", train)
        self.register_buffer("test_features", test)


class CountingKNN(KNNEvaluator):
    """kNN on the encoder's given features, counting the encodings and the fits."""

    def __init__(self, patients: bool = True):
        super().__init__(KNNConfig(dataset={"name": "hand-made"}, k=3, reading="mean", bootstrap=300), None, None, None)
        groups = [f"patient:{i // 2}" for i in range(N_TEST)] if patients else None
        self._split = (_volumes(TRAIN_LABELS, None), _volumes(TEST_LABELS, groups))
        self.encoded: list[str] = []
        self.fits = 0

    def encode(self, model, device):
        self.encoded.append(model.name)
        return Encoded(model.train_features, model.test_features)

    def score(self, encoded, positions=None):
        self.fits += 1
        return super().score(encoded, positions)


def _shots(monkeypatch, evaluator, encoders: dict[str, Encoder], shots=(3,), draws: int = 3) -> ShotsReport:
    monkeypatch.setattr(label_efficiency, "build_evaluators", lambda target, recipe, registry: [("knn", evaluator)])
    random_init = Encoder("random", 99, 0.0)
    targets = {name: EvalTarget(f"/runs/{name}", 10, encoder, random_init, {}, None, None)
               for name, encoder in encoders.items()}
    recipe = SimpleNamespace(run=SimpleNamespace(seed=0, device="cpu"))
    return evaluate_shots(targets, recipe, None, shots, draws)


def test_every_draw_is_a_row_with_its_interval_and_its_paired_difference_and_the_mean_gain_has_one(monkeypatch):
    report = _shots(monkeypatch, CountingKNN(), {"pretrained": Encoder("pretrained", 1, 4.0)})
    draws = {(r["encoder"], r["draw"]): r for r in report.draw_rows if r["metric"] == "auroc"}
    assert set(draws) == {(e, d) for e in ("pretrained", RANDOM_INIT) for d in (1, 2, 3)}
    for draw in (1, 2, 3):
        mine, baseline = draws[("pretrained", draw)], draws[(RANDOM_INIT, draw)]
        assert mine["ci_low"] <= mine["value"] <= mine["ci_high"]  # each fit's own bootstrap interval
        assert mine["difference"] == pytest.approx(mine["value"] - baseline["value"])  # paired by draw
        assert mine["difference_ci_low"] <= mine["difference"] <= mine["difference_ci_high"]
        assert baseline["difference"] == ""  # the baseline has no difference from itself
    (summary,) = [r for r in report.rows if (r["encoder"], r["metric"]) == ("pretrained", "auroc")]
    assert summary["draws"] == 3
    assert summary["difference"] == pytest.approx(np.mean([draws[("pretrained", d)]["difference"] for d in (1, 2, 3)]))
    assert summary["difference_ci_low"] <= summary["difference"] <= summary["difference_ci_high"]
    assert summary["difference_ci_low"] > 0  # an informative encoder against a random one: a gain, shown as one
    table = format_shots(report)
    assert f"{summary['difference']:+.3f} [{summary['difference_ci_low']:+.2f}, " in table
    assert "test      knn: 24 volumes of 12 patients" in table
    assert report.csv_rows() == report.draw_rows  # the run folder's eval/ CSV: a row per draw


def test_the_mean_gains_interval_resamples_patients_not_volumes(monkeypatch):
    """The test volumes come in identical pairs (one patient's): resampling volumes one by one
    would count each patient twice and give too narrow an interval."""
    encoder = {"pretrained": Encoder("pretrained", 1, 0.7)}
    widths = {}
    for patients in (True, False):
        report = _shots(monkeypatch, CountingKNN(patients=patients), encoder)
        (row,) = [r for r in report.rows if (r["encoder"], r["metric"]) == ("pretrained", "auroc")]
        widths[patients] = row["difference_ci_high"] - row["difference_ci_low"]
    assert widths[True] > 1.2 * widths[False]


def test_the_random_baseline_is_fitted_once_per_draw_for_every_encoder_side_by_side(monkeypatch):
    evaluator = CountingKNN()
    encoders = {"published": Encoder("published", 1, 2.0), "continued": Encoder("continued", 2, 1.0)}
    report = _shots(monkeypatch, evaluator, encoders, shots=(3, None), draws=2)
    assert evaluator.encoded == ["published", "continued", "random"]  # each encoded once
    assert evaluator.fits == 3 * (2 + 1)  # three networks x (two draws of 3, one of all): not 4 x 3
    assert {r["encoder"] for r in report.rows} == {"published", "continued", RANDOM_INIT}
    random_rows = [r for r in report.draw_rows if r["encoder"] == RANDOM_INIT and r["metric"] == "auroc"]
    assert len(random_rows) == 3  # one row per fit, shared by both encoders' differences
    table = format_shots(report)
    assert "published - random" in table and "continued - random" in table
    assert "fitted once per draw for all" in table


def test_the_gain_over_several_fits_is_the_mean_of_each_fits_gain_on_shared_resamples():
    rng = np.random.default_rng(0)
    labels = np.repeat([0, 1], 30)
    classes = np.array([0, 1])
    fits = [np.stack([1 - p, p], axis=1) for p in rng.uniform(size=(3, 60)) * 0.5 + labels * 0.3]
    baseline = [np.stack([1 - p, p], axis=1) for p in rng.uniform(size=(3, 60))]
    single = [paired_difference(labels, a, b, classes, bootstrap=200, seed=1) for a, b in zip(fits, baseline)]
    stacked = paired_difference(labels, np.stack(fits), np.stack(baseline), classes, bootstrap=200, seed=1)
    for key in ("auroc", "balanced_accuracy"):
        assert stacked[key] == pytest.approx(np.mean([s[key] for s in single]))
        assert stacked[f"{key}_ci_low"] <= stacked[key] <= stacked[f"{key}_ci_high"]
    same = paired_difference(labels, np.stack([fits[0]] * 3), np.stack([baseline[0]] * 3), classes, bootstrap=200,
                             seed=1)
    assert same == pytest.approx(single[0])  # three equal fits: the one fit's gain and interval


def test_a_dense_overlap_difference_is_paired_per_patient_and_averages_fits():
    from octfw.evaluation.metrics import overlap_difference, overlap_metrics

    rng = np.random.default_rng(3)
    truth = rng.integers(20, 40, 24).astype(np.float64)
    counts = []
    for quality in (0.8, 0.4):
        predicted = truth + rng.integers(0, 10, 24)
        counts.append(np.stack([np.floor(quality * truth), predicted, truth], axis=1))
    domains, groups = ["a", "b"] * 12, [f"p{i // 2}" for i in range(24)]
    options = dict(groups=groups, bootstrap=300, seed=2)
    difference = overlap_difference(counts[0], counts[1], domains, prefix="voxel_", **options)
    single = [overlap_metrics(*c.T, domains, prefix="voxel_", **options) for c in counts]
    for key in ("voxel_dice", "voxel_iou", "voxel_dice/a"):
        assert difference[key] == pytest.approx(single[0][key] - single[1][key])
    low, high = interval_keys("voxel_dice")
    assert 0 < difference[low] <= difference["voxel_dice"] <= difference[high]
    by_volume = overlap_difference(counts[0], counts[1], domains, prefix="voxel_", bootstrap=300, seed=2)
    assert by_volume[low] != difference[low]  # the patients are what is resampled
    stacked = overlap_difference(np.stack([counts[0], counts[1]]), np.stack([counts[1], counts[1]]), domains,
                                 prefix="voxel_", **options)
    assert stacked["voxel_dice"] == pytest.approx(difference["voxel_dice"] / 2)


def test_a_one_class_evaluators_table_counts_volumes_not_volumes_per_class():
    def rows(per_class: float, training: float) -> list[dict]:
        return [{"encoder": e, "evaluator": "seg", "shots": "2", "volumes_per_class": per_class,
                 "training_volumes": training, "validation_volumes": 3.0, "metric": "mean_dice", "mean": 0.5,
                 "std": 0.1, "draws": 2, "difference": "" if e == RANDOM_INIT else 0.1, "difference_ci_low": "",
                 "difference_ci_high": ""} for e in ("pretrained", RANDOM_INIT)]

    segmentation = format_shots(ShotsReport("/enc", None, 0, "cpu", ["2"], 2, rows(2.0, 2.0)))
    assert "per class" not in segmentation and "2 + 3 val" in segmentation and "+0.100" in segmentation
    assert "no interval" in segmentation  # a difference without an interval says why
    classifier = format_shots(ShotsReport("/enc", None, 0, "cpu", ["2"], 2, rows(2.0, 4.0)))
    assert "per class" in classifier


def test_the_help_says_what_shots_counts_and_the_segmentation_metrics():
    from octfw.cli.main import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    parser = commands["eval"]
    helps = {action.dest: action.help for action in parser._actions}
    assert "layer-segmentation: K volumes" in helps["shots"] and "per class" in helps["shots"]
    assert "mean_dice for layer-segmentation" in helps["metric"]
    assert "boundary errors in µm and in rows" in parser.description and "95 % interval" in parser.description


def test_the_report_states_the_test_split_and_the_row_spacing_of_boundary_errors():
    summary = {"knn": {"volumes": 12, "patients": None},
               "layer-segmentation": {"volumes": 9, "patients": 5,
                                      "row_spacing_um": {"heidelberg": 3.87, "topcon": None}}}
    line = format_test_split(summary, ["knn", "layer-segmentation", "plugin"])
    assert "knn: 12 volumes, patients not known" in line and "layer-segmentation: 9 volumes of 5 patients" in line
    assert "plugin: not known" in line
    (legend,) = boundary_legend(summary, ["layer-segmentation/boundary_error_um", "knn/auroc"])
    assert "3.87 µm (heidelberg)" in legend and "topcon: no axial spacing given, so in rows only" in legend
    assert boundary_legend(summary, ["layer-segmentation/mean_dice"]) == []  # no boundary error shown


# --- progress -------------------------------------------------------------------------------


def test_a_log_gets_a_progress_line_every_so_often_not_one_per_update(monkeypatch, caplog):
    import octfw.display.progress
    from octfw.display.progress import progress_bar

    now = [0.0]
    monkeypatch.setattr(octfw.display.progress, "clock", lambda: now[0])
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    with caplog.at_level(logging.INFO, logger="octfw.display.progress"):
        with progress_bar("eval", text="loading volumes", log_every=30.0) as update:
            for at, done in ((10.0, 1), (31.0, 2), (40.0, 3), (45.0, 4)):
                now[0] = at
                update(done, 4, f"unit {done}")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["eval: 2/4 (0:31) unit 2", "eval: 4/4 (0:45) unit 4"]  # 30 s apart, and the end

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="octfw.display.progress"):
        with progress_bar("eval", log_every=30.0) as update:
            now[0] = 50.0
            update(4, 4, "done")  # a quick command: nothing logged, so a one-line error stays one line
    assert caplog.records == []


def test_a_long_first_unit_still_logs_while_it_runs(monkeypatch, caplog):
    from octfw.display.progress import progress_bar

    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="octfw.display.progress"):
        with progress_bar("eval", text="loading volumes", log_every=0.05):
            time.sleep(0.3)  # no update yet: the volumes are still loading
    assert any(r.getMessage().startswith("eval: (0:00) loading volumes") for r in caplog.records)
    assert not any(t.name == "octfw-progress-log" for t in threading.enumerate())  # its watcher ended


def test_a_layer_segmentation_fit_shows_its_steps_in_the_progress():
    from test_layer_segmentation import ToyLayers, _encoder, _evaluator

    evaluator = _evaluator(ToyLayers(8), epochs=3, fit_batch_size=2)
    encoded = evaluator.encode(_encoder(depth=2), "cpu")
    seen: list[tuple[int, int, str]] = []
    counter = Counter(4, lambda done, total, text: seen.append((done, total, text)))
    counter.finished("pretrained: encoded")
    with counter.running("pretrained: layer-segmentation"):
        evaluator.score(encoded)
    steps = [text for _, _, text in seen if "fit step" in text]
    fit_volumes = len(evaluator.fit_positions())
    total = 3 * -(-fit_volumes // 2)
    assert steps == [f"pretrained: layer-segmentation: fit step {s}/{total}" for s in range(1, total + 1)]
    assert all(done == 1 and of == 4 for done, of, text in seen[1:])  # within the second unit
