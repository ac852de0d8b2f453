"""Evaluation metrics, bootstrap intervals, patient-level splits and shot sampling.

Hand-computed values: AUROC is P(positive scored above a negative), ties
counting half; AUPRC is average precision, the precision at each distinct
threshold weighted by the recall gained there.
"""

from __future__ import annotations

import numpy as np
import pytest

from octfw.dicom.manifest import ManifestRow, read_manifest, write_manifest
from octfw.display.errors import UserError
from octfw.evaluation.features import stratified_split
from octfw.evaluation.metrics import auprc, auroc, bootstrap_weights, classification_metrics, one_vs_rest
from octfw.evaluation.shots import parse_shots, sample_per_class, summarise

# --- AUROC and AUPRC by hand --------------------------------------------------------


def test_auroc_and_auprc_match_hand_computed_values():
    labels = np.array([0, 0, 1, 1])
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    # Pairs (pos, neg): 0.35>0.1, 0.35<0.4, 0.8>0.1, 0.8>0.4 -> 3 of 4.
    assert auroc(labels, scores) == 0.75
    # Thresholds down: 0.8 (P=1/1, recall 1/2), 0.4 (no positive), 0.35 (P=2/3, recall 2/2).
    assert auprc(labels, scores) == pytest.approx(0.5 * 1.0 + 0.5 * 2 / 3)


def test_tied_scores_count_half_in_auroc_and_as_one_threshold_in_auprc():
    labels = np.array([1, 0, 1, 0, 0])
    scores = np.array([0.9, 0.9, 0.5, 0.2, 0.1])
    # Positive 0.9 vs negatives 0.9 (tie, 1/2), 0.2, 0.1 -> 2.5; positive 0.5 -> 2 of 3 -> 4.5 / 6.
    assert auroc(labels, scores) == pytest.approx(4.5 / 6)
    # Threshold 0.9 takes both tied volumes: precision 1/2, recall 1/2; then 0.5: precision 2/3.
    assert auprc(labels, scores) == pytest.approx(0.5 * 0.5 + 0.5 * 2 / 3)
    assert auroc(np.array([0, 0]), np.array([0.1, 0.2])) is None
    assert auprc(np.array([1, 1]), np.array([0.1, 0.2])) is None


def test_multi_class_auroc_is_the_macro_mean_of_one_vs_rest():
    labels = np.array([0, 1, 2, 0, 1, 2])
    probabilities = np.array([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4],
                              [0.5, 0.4, 0.1], [0.6, 0.3, 0.1], [0.1, 0.2, 0.7]])
    classes = np.array([0, 1, 2])
    expected = np.mean([auroc((labels == c).astype(int), probabilities[:, c]) for c in range(3)])
    expected_ap = np.mean([auprc((labels == c).astype(int), probabilities[:, c]) for c in range(3)])
    areas = one_vs_rest(labels, probabilities, classes, np.ones((1, 6)))
    assert areas["auroc"][0] == pytest.approx(expected) and areas["auprc"][0] == pytest.approx(expected_ap)
    # Class 0 by hand: positives score 0.8, 0.5 against 0.2, 0.3, 0.6, 0.1 -> (4 + 3) / 8.
    assert auroc((labels == 0).astype(int), probabilities[:, 0]) == pytest.approx(7 / 8)
    metrics = classification_metrics(labels, probabilities, classes, ["a"] * 6)
    assert metrics["auroc"] == pytest.approx(expected) and metrics["accuracy"] == pytest.approx(5 / 6)


def test_two_classes_with_other_labels_take_the_higher_one_as_positive():
    metrics = classification_metrics(np.array([3, 3, 7, 7]), np.array([[0.9, 0.1], [0.6, 0.4], [0.65, 0.35],
                                                                        [0.2, 0.8]]),
                                     np.array([3, 7]), ["a"] * 4)
    assert metrics["auroc"] == 0.75


# --- bootstrap intervals -----------------------------------------------------------------


def _scored(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 2
    scores = labels + rng.normal(0.0, 1.0, n)
    return labels, np.stack([-scores, scores], axis=1)


def test_the_bootstrap_interval_contains_the_estimate_and_narrows_with_more_volumes():
    widths = {}
    for n in (40, 400):
        labels, probabilities = _scored(n, seed=n)
        metrics = classification_metrics(labels, probabilities, np.array([0, 1]), ["a"] * n, bootstrap=500, seed=1)
        for key in ("auroc", "auprc"):
            assert metrics[f"{key}_ci_low"] <= metrics[key] <= metrics[f"{key}_ci_high"]
        widths[n] = metrics["auroc_ci_high"] - metrics["auroc_ci_low"]
    # About 1 / sqrt(n): ten times the volumes, a third of the width.
    assert widths[400] < 0.5 * widths[40]


def test_the_bootstrap_is_seeded_and_left_out_when_asked_for_none():
    labels, probabilities = _scored(60, seed=0)
    domains = ["a", "a", "b", "b"] * 15  # both classes in each domain

    def metrics(**options):
        return classification_metrics(labels, probabilities, np.array([0, 1]), domains, **options)

    first = metrics(bootstrap=200, seed=4)
    assert first == metrics(bootstrap=200, seed=4) and first != metrics(bootstrap=200, seed=5)
    assert "auroc_ci_low/b" in first and "auprc_ci_high/a" in first
    plain = metrics()
    assert not any("_ci_" in key for key in plain) and plain["auroc"] == first["auroc"]


def test_a_patient_bootstrap_draws_whole_patients():
    groups = ["p1", "p1", "p1", "p2", "p3", "p3"]
    weights = bootstrap_weights(6, 300, np.random.default_rng(0), groups)
    assert weights.shape == (300, 6)
    assert (weights[:, 0] == weights[:, 1]).all() and (weights[:, 1] == weights[:, 2]).all()
    assert (weights[:, 4] == weights[:, 5]).all()
    # Three patients drawn with replacement: each row draws 3 patients.
    assert (weights[:, [0, 3, 4]].sum(axis=1) == 3).all()


def test_patients_widen_the_interval_when_their_volumes_agree():
    # Each patient's four volumes have the same score: resampling volumes one by one
    # would pretend to four times the evidence.
    rng = np.random.default_rng(3)
    patient_labels = np.arange(30) % 2
    patient_scores = patient_labels + rng.normal(0.0, 1.0, 30)
    labels, scores = np.repeat(patient_labels, 4), np.repeat(patient_scores, 4)
    probabilities = np.stack([-scores, scores], axis=1)
    groups = np.repeat(np.arange(30), 4)
    by_volume = classification_metrics(labels, probabilities, np.array([0, 1]), ["a"] * 120, bootstrap=500)
    by_patient = classification_metrics(labels, probabilities, np.array([0, 1]), ["a"] * 120, bootstrap=500,
                                        groups=groups)
    width = lambda m: m["auroc_ci_high"] - m["auroc_ci_low"]  # noqa: E731
    assert width(by_patient) > 1.5 * width(by_volume)


# --- splits by patient ----------------------------------------------------------------------


def test_a_patient_split_never_puts_one_patient_on_both_sides():
    rng = np.random.default_rng(0)
    patients = [f"p{rng.integers(0, 25)}" for _ in range(90)]
    labels = rng.integers(0, 2, 90)
    domains = [str(d) for d in rng.choice(["heidelberg", "topcon"], 90)]
    for seed in range(5):
        train, test = stratified_split(labels, domains, 0.5, seed, groups=patients)
        assert sorted(train + test) == list(range(90))
        assert not {patients[i] for i in train} & {patients[i] for i in test}
        assert 0.25 < len(train) / 90 < 0.75
    assert stratified_split(labels, domains, 0.5, 1, groups=patients) == \
        stratified_split(labels, domains, 0.5, 1, groups=patients)


def test_one_volume_per_patient_splits_exactly_as_without_patients():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 50)
    domains = [str(d) for d in rng.choice(["a", "b", "c"], 50)]
    for seed in range(4):
        assert stratified_split(labels, domains, 0.6, seed, groups=[f"v{i}" for i in range(50)]) == \
            stratified_split(labels, domains, 0.6, seed)


def test_the_manifest_patient_column_is_read_and_written_only_when_given(tmp_path):
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label,patient\na.dcm,1,P-7\nb.dcm,0,\nc.dcm,0,P-7\n", encoding="utf-8")
    rows = read_manifest(str(manifest))
    assert [r.patient for r in rows] == ["P-7", None, "P-7"]
    out = tmp_path / "out.jsonl"
    write_manifest(str(out), rows)
    assert [r.patient for r in read_manifest(str(out))] == ["P-7", None, "P-7"]
    write_manifest(str(out), [ManifestRow(path=str(tmp_path / "a.dcm"), label=1)])
    assert "patient" not in out.read_text(encoding="utf-8")


# --- shots --------------------------------------------------------------------------------


def test_shot_counts_parse_and_bad_ones_are_one_line_user_errors():
    assert parse_shots("5, 10,50,all") == (5, 10, 50, None)
    for text, message in (("0", "cannot train"), ("5,x", "'x' is not a count"), ("5,5", "listed twice"),
                          ("-3", "cannot train"), ("", "is not a count")):
        with pytest.raises(UserError, match=message) as info:
            parse_shots(text)
        assert "\n" not in str(info.value)


def test_shots_draw_k_volumes_of_every_class_from_the_pool_with_a_seed():
    labels = np.array([0, 1] * 20 + [2] * 6)
    pool = np.arange(0, 46, 1)[np.arange(46) % 5 != 0]  # some volumes are not in the pool
    chosen = sample_per_class(labels, pool, 4, np.random.default_rng([0, 4, 0]))
    assert set(chosen) <= set(pool.tolist())
    assert [int((labels[chosen] == c).sum()) for c in (0, 1, 2)] == [4, 4, 4]
    assert (chosen == sample_per_class(labels, pool, 4, np.random.default_rng([0, 4, 0]))).all()
    assert not (chosen == sample_per_class(labels, pool, 4, np.random.default_rng([0, 4, 1]))).all()
    with pytest.raises(UserError, match="has 4 volumes of label 2"):
        sample_per_class(labels, pool, 5, np.random.default_rng(0))


def test_draws_summarise_as_mean_and_sample_std():
    summary = summarise([{"auroc": 0.6, "accuracy": 0.5}, {"auroc": 0.8, "accuracy": 0.7}])
    assert summary["auroc"][0] == pytest.approx(0.7) and summary["auroc"][1] == pytest.approx(np.sqrt(0.02))
    assert summarise([{"auroc": 0.6}])["auroc"] == (0.6, 0.0)
