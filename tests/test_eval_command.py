"""``octfw eval`` over a real short run: checkpoints compared, label efficiency, patients.

One tiny run (6 update steps, a checkpoint every 2) is trained once for the
module; the evaluators probe it through the command line as a user would.
The attentive probe also runs inside that training, as an evaluator stage.
"""

from __future__ import annotations

import csv
import io
import json
import textwrap
from pathlib import Path

import pytest

from octfw.cli.main import main
from octfw.dicom.manifest import ManifestRow, read_manifest, write_manifest
from octfw.engine.build import build_components
from octfw.engine.trainer import train
from octfw.display.errors import UserError
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.runs.folder import create_run_dir

from conftest import TINY_RECIPE

LABELLED = '{ name = "synthetic-oct", n_volumes = 24, labels = true, seed = 5 }'
# A small grid and few epochs: the mechanics, not the probe's quality, are under test here.
ATTENTIVE = f"""
[[evaluator]]
name = "attentive-probe"
dataset = {LABELLED}
learning_rates = [0.01]
weight_decays = [0.01, 0.1]
max_epochs = 4
bootstrap = 100
"""
EVAL_RECIPE = f"""
[run]
seed = 3
device = "cpu"

[[evaluator]]
name = "knn"
dataset = {LABELLED}
k = 3
bootstrap = 100
{ATTENTIVE}
"""


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("short")
    path = root / "short.toml"
    path.write_text(TINY_RECIPE + ATTENTIVE.replace("max_epochs = 4", "max_epochs = 4\nevery_steps = 3"),
                    encoding="utf-8")
    registry = load_registry()
    # A fast EMA, so that the target encoder the probes read moves between checkpoints.
    overrides = ["run.max_steps=6", "engine.checkpoint_every_steps=2", "scheduler.ema_start=0.5",
                 "scheduler.ema_end=0.5"]
    recipe = load_recipe(path, overrides, registry)
    run_dir = create_run_dir(recipe, registry)
    train(recipe, registry, run_dir)
    return run_dir


@pytest.fixture
def eval_recipe(tmp_path) -> Path:
    path = tmp_path / "eval.toml"
    path.write_text(textwrap.dedent(EVAL_RECIPE), encoding="utf-8")
    return path


def _json(capsys, *args: str) -> dict:
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, *args: str) -> str:
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err.strip()
    # Progress lines (stderr is no terminal here) and warnings may precede the one error line.
    errors = [line for line in err.splitlines() if not line.startswith(("octfw: warning:", "eval: "))]
    assert "Traceback" not in err and len(errors) == 1, err
    return errors[0]


def test_the_attentive_probe_runs_as_an_evaluator_stage_during_training(short_run):
    records = [json.loads(line) for line in (short_run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "eval/attentive-probe/accuracy" in r]
    assert [r["step"] for r in logged] == [3, 6]
    last = logged[-1]
    assert last["eval/attentive-probe/selected_lr"] == 0.01
    assert last["eval/attentive-probe/selected_weight_decay"] in (0.01, 0.1)
    assert 0.0 <= last["eval/attentive-probe/auroc"] <= 1.0


def test_every_saved_checkpoint_is_probed_and_the_metric_plotted_against_the_step(short_run, eval_recipe,
                                                                                 tmp_path, capsys):
    png = tmp_path / "curve.png"
    report = _json(capsys, str(short_run), "--recipe", str(eval_recipe), "--checkpoints", "all", "--png", str(png))
    assert report["steps"] == [2, 4, 6] and len(report["pretrained"]) == 3
    assert report["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for scores in report["pretrained"] + [report["random_init"]]:
        assert {"knn/auroc", "knn/auprc_ci_low", "attentive-probe/balanced_accuracy",
                "attentive-probe/selected_lr"} <= set(scores)
        assert scores["knn/auroc_ci_low"] <= scores["knn/auroc"] <= scores["knn/auroc_ci_high"]
    # The checkpoints differ, so do their features: the comparison is not one model thrice.
    assert report["pretrained"][0] != report["pretrained"][2]
    # Each checkpoint's difference from the baseline, paired, in the JSON and the run folder's CSV.
    assert len(report["differences"]) == 3
    for scores, difference in zip(report["pretrained"], report["differences"]):
        assert difference["knn/auroc"] == pytest.approx(scores["knn/auroc"] - report["random_init"]["knn/auroc"])
        assert difference["knn/auroc_ci_low"] <= difference["knn/auroc"] <= difference["knn/auroc_ci_high"]
    assert report["test_split"]["knn"] == {"volumes": 12, "patients": None}
    with (short_run / "eval" / f"checkpoints-{eval_recipe.stem}.csv").open(encoding="utf-8") as f:
        kept = {(r["update_step"], r["metric"]): r for r in csv.DictReader(f)}
    assert float(kept[("6", "knn/auroc")]["difference_ci_high"]) == report["differences"][2]["knn/auroc_ci_high"]

    # The newest checkpoint gives what a plain `octfw eval` of the run folder gives, baseline included.
    plain = _json(capsys, str(short_run), "--recipe", str(eval_recipe))
    assert plain["update_step"] == 6
    assert plain["pretrained"] == report["pretrained"][2] and plain["random_init"] == report["random_init"]


def test_chosen_checkpoints_are_probed_in_step_order_and_the_table_shows_them(short_run, eval_recipe, capsys):
    assert main(["eval", str(short_run), "--recipe", str(eval_recipe), "--set", "evaluator.1.max_epochs=1",
                 "--checkpoints", "4,2"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("\nknn:") + 1:out.index("\nattentive-probe:")]
    rows = [line.split()[0] for line in table.splitlines()[2:] if line.strip()]
    assert rows == ["2", "4", "random"]
    assert "[" in table and (short_run / "eval_checkpoints.png").is_file()


def test_bad_checkpoint_choices_are_one_line_user_errors(short_run, eval_recipe, tmp_path, capsys):
    recipe = str(eval_recipe)
    err = _error(capsys, str(short_run), "--recipe", recipe, "--checkpoints", "5")
    assert "no saved checkpoint at update step 5 (saved: 2, 4, 6)" in err
    assert "'last' is not an update step" in _error(capsys, str(short_run), "--recipe", recipe,
                                                    "--checkpoints", "last")
    checkpoint = short_run / "checkpoints" / "step_00000006.pt"
    assert "not a run folder" in _error(capsys, str(checkpoint), "--recipe", recipe, "--checkpoints", "all")
    assert "give one of them" in _error(capsys, str(short_run), "--recipe", recipe, "--checkpoints", "all",
                                        "--shots", "2")


def test_label_efficiency_prints_a_table_and_writes_a_png_and_a_csv(short_run, eval_recipe, tmp_path, capsys):
    png = tmp_path / "shots" / "efficiency.png"
    args = [str(short_run), "--recipe", str(eval_recipe), "--shots", "2,all", "--draws", "2", "--png", str(png)]
    report = _json(capsys, *args)
    assert report["shots"] == ["2", "all"] and report["draws"] == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["csv"] == str(png.with_suffix(".csv"))
    with png.with_suffix(".csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    auroc = {(r["encoder"], r["evaluator"], r["shots"]): r for r in rows if r["metric"] == "auroc"}
    assert set(auroc) == {(e, v, s) for e in ("pretrained", "random_init")
                          for v in ("knn", "attentive-probe") for s in ("2", "all")}
    assert auroc[("pretrained", "knn", "2")]["draws"] == "2"
    assert auroc[("pretrained", "knn", "all")]["draws"] == "1"
    assert float(auroc[("pretrained", "knn", "all")]["std"]) == 0.0
    assert float(auroc[("pretrained", "knn", "2")]["volumes_per_class"]) == 2.0
    # Every labelled volume a fit used: knn's 2 per class of 2 classes; the attentive probe's too,
    # and its whole validation split, which chooses the grid member at every shot count.
    assert float(auroc[("pretrained", "knn", "2")]["training_volumes"]) == 4.0
    assert float(auroc[("pretrained", "knn", "2")]["validation_volumes"]) == 0.0
    validation = float(auroc[("pretrained", "attentive-probe", "2")]["validation_volumes"])
    assert validation > 0 and float(auroc[("pretrained", "attentive-probe", "2")]["training_volumes"]) == 4.0
    kept = json.loads((short_run / "eval" / f"shots-{eval_recipe.stem}.json").read_text(encoding="utf-8"))
    assert {(r["evaluator"], r["shots"], r["training_volumes"], r["validation_volumes"]) for r in kept["rows"]
            if r["encoder"] == "pretrained"} >= {("attentive-probe", "2", 4.0, validation), ("knn", "2", 4.0, 0.0)}

    first_csv = png.with_suffix(".csv").read_text(encoding="utf-8")
    assert main(["eval", *args]) == 0
    table = capsys.readouterr().out
    assert "attentive-probe:" in table and " ± " in table and f"png       {png}" in table
    assert f"4 + {validation:g} val" in table and "labelled  the training volumes drawn" in table
    assert f"4 + {validation:g} val" in (short_run / "eval" / f"shots-{eval_recipe.stem}.txt").read_text()
    all_rows = [line for line in table.splitlines() if line.strip().startswith("all ")]
    assert all_rows and not any("±" in line for line in all_rows)  # one draw: its value, no spread
    # Written again by the second run: seeded draws and deterministic probes give the same numbers.
    assert png.with_suffix(".csv").read_text(encoding="utf-8") == first_csv


def test_encoders_side_by_side_share_one_random_baseline_with_shots_and_keep_differences(short_run, eval_recipe,
                                                                                         tmp_path, capsys):
    """The run folder and its exported encoder (the same weights) side by side, with --shots: the
    random encoder is fitted once per draw, both differences rest on the same random fits, and the
    run folder (not the export) keeps the report; without --shots, --json and eval/ carry the
    differences with their intervals too."""
    export = short_run / "encoder"
    png = tmp_path / "both.png"
    report = _json(capsys, str(short_run), str(export), "--names", "run,export", "--recipe", str(eval_recipe),
                   "--set", "evaluator.1.max_epochs=1", "--shots", "2", "--draws", "2", "--png", str(png))
    assert list(report["encoders"]) == ["run", "export"]
    draws = {(r["encoder"], r["evaluator"], r["draw"]): r for r in report["draw_rows"] if r["metric"] == "auroc"}
    assert {key for key in draws if key[0] == "random_init"} == {("random_init", e, d) for e in
                                                                 ("knn", "attentive-probe") for d in (1, 2)}
    for evaluator in ("knn", "attentive-probe"):
        for draw in (1, 2):
            run, exported = draws[("run", evaluator, draw)], draws[("export", evaluator, draw)]
            assert run["value"] == exported["value"] and run["difference"] == exported["difference"]
    kept = json.loads((short_run / "eval" / f"shots-{eval_recipe.stem}.json").read_text(encoding="utf-8"))
    assert kept["draw_rows"] == report["draw_rows"] and not (export / "eval").exists()
    assert png.with_name("both_draws.csv").is_file()

    side = _json(capsys, str(short_run), str(export), "--names", "run,export", "--recipe", str(eval_recipe),
                 "--set", "evaluator.1.max_epochs=1")
    for name in ("run", "export"):
        assert side["differences"][name]["knn/auroc_ci_low"] <= side["differences"][name]["knn/auroc"]
        assert "knn/balanced_accuracy" in side["differences"][name]
    assert side["test_split"]["knn"]["volumes"] == 12
    compared = json.loads((short_run / "eval" / f"compare-{eval_recipe.stem}.json").read_text(encoding="utf-8"))
    assert compared["differences"] == side["differences"]


def test_bad_shot_counts_are_one_line_user_errors(short_run, eval_recipe, capsys):
    recipe = str(eval_recipe)
    assert "cannot train a classifier" in _error(capsys, str(short_run), "--recipe", recipe, "--shots", "0")
    assert "use at most" in _error(capsys, str(short_run), "--recipe", recipe, "--shots", "50")
    assert "--draws applies to --shots" in _error(capsys, str(short_run), "--recipe", recipe, "--draws", "2")


def test_the_difference_carries_a_paired_interval_and_a_small_test_split_is_warned_about(
        short_run, eval_recipe, capsys):
    """Both encoders are scored on the same bootstrap resamples: the difference column is the gain
    with its own interval, which holds the gain; 12 test volumes get a warning naming the counts."""
    report = _json(capsys, str(short_run), "--recipe", str(eval_recipe))
    for evaluator in ("knn", "attentive-probe"):
        gain = report["pretrained"][f"{evaluator}/auroc"] - report["random_init"][f"{evaluator}/auroc"]
        difference = report["difference"]
        assert difference[f"{evaluator}/auroc"] == pytest.approx(gain)
        assert difference[f"{evaluator}/auroc_ci_low"] <= gain <= difference[f"{evaluator}/auroc_ci_high"]
    assert main(["eval", str(short_run), "--recipe", str(eval_recipe)]) == 0
    out, err = capsys.readouterr()
    low, high = report["difference"]["knn/auroc_ci_low"], report["difference"]["knn/auroc_ci_high"]
    assert f"[{low:+.2f}, {high:+.2f}]" in out and "paired bootstrap" in out
    # Balanced accuracy's difference is paired too; the test split is stated (no patient column here).
    assert report["difference"]["knn/balanced_accuracy_ci_low"] <= report["difference"]["knn/balanced_accuracy"]
    assert report["test_split"] == {"knn": {"volumes": 12, "patients": None},
                                    "attentive-probe": {"volumes": 12, "patients": None}}
    assert "test      knn: 12 volumes, patients not known (each volume resampled alone)" in out
    assert "octfw: warning: evaluator knn: the test split holds 7 volumes of class 0, 5 volumes of class 1" in err


def test_the_paired_difference_is_narrower_than_two_separate_intervals():
    """Two models that share most of their errors: the paired interval of the gain is far narrower
    than the span of the two separate intervals (what comparing them by eye would suggest)."""
    import numpy as np

    from octfw.evaluation.metrics import classification_metrics, paired_difference

    rng = np.random.default_rng(0)
    labels = np.repeat([0, 1], 40)
    shared = rng.normal(size=80) + labels * 1.0  # the hard cases are hard for both
    first = np.stack([-(shared + 0.3 * labels), shared + 0.3 * labels], axis=1)
    second = np.stack([-shared, shared], axis=1)
    classes = np.array([0, 1])
    difference = paired_difference(labels, first, second, classes, bootstrap=500, seed=1)
    separate = [classification_metrics(labels, p, classes, ["d"] * 80, bootstrap=500, seed=1)
                for p in (first, second)]
    assert difference["auroc"] == pytest.approx(separate[0]["auroc"] - separate[1]["auroc"])
    assert difference["auroc_ci_low"] > 0  # a real gain, shown as one
    paired_width = difference["auroc_ci_high"] - difference["auroc_ci_low"]
    assert paired_width < 0.5 * (separate[0]["auroc_ci_high"] - separate[1]["auroc_ci_low"])


def test_the_progress_bar_goes_to_a_terminal_stderr_only(monkeypatch):
    from octfw.display.progress import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with progress_bar("eval") as update:
        update(1, 4, "pretrained: linear-probe")
    assert update is not None and "eval" in terminal.getvalue() and "ETA" not in terminal.getvalue()

    terminal = Terminal()  # octfw prepare's: items of about equal cost get a rate and an ETA
    monkeypatch.setattr("sys.stderr", terminal)
    with progress_bar("prepare", unit="volumes") as update:
        update(1, 4)
        update(2, 4)
    assert "prepare" in terminal.getvalue() and "ETA" in terminal.getvalue()

    monkeypatch.setattr("sys.stderr", io.StringIO())
    with progress_bar("eval") as update:
        assert update is None


def test_the_rate_is_the_average_since_work_began_in_readable_figures(monkeypatch):
    """48 volumes in 12 s after a 10 s cluster start read 4 volumes/s, not the burst's rate;
    slow work reads seconds per volume."""
    import octfw.display.progress
    from octfw.display.progress import progress_bar, rate_text

    assert rate_text(48, 12.0, "volumes") == "4 volumes/s"
    assert rate_text(7, 3.0, "volumes") == "2.33 volumes/s"
    assert rate_text(3, 7.5, "volumes") == "2.5 s per volume"

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock = iter([10.0, 21.0, 22.0])  # work begins at 10 s (after the cluster), then a burst of 40 at 22 s
    monkeypatch.setattr(octfw.display.progress, "clock", lambda: next(clock))
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with progress_bar("prepare", unit="volumes") as update:
        update(0, 48)
        update(8, 48)
        update(48, 48)
    assert "4 volumes/s" in terminal.getvalue()


# --- patients ------------------------------------------------------------------------


def _patient_manifest(tmp_path: Path, registry, share_with: list[str] | None = None) -> tuple[Path, list]:
    """The labelled synthetic cohort's manifest again, with a patient column: volumes 2k and 2k+1
    (two domains, often two labels) belong to one patient."""
    recipe = load_recipe(_write(tmp_path, TINY_RECIPE + f"\n[[evaluator]]\nname = \"knn\"\ndataset = {LABELLED}\n"),
                         (), registry)
    source = build_components(recipe, registry, run_dir=None).evaluators[0].train_dataset.location
    rows = read_manifest(source)
    with_patients = [ManifestRow(path=r.path, domain=r.domain, label=r.label, patient=f"anon-{i // 2}")
                     for i, r in enumerate(rows)]
    manifest = tmp_path / "patients.jsonl"
    write_manifest(str(manifest), with_patients, relative=False)
    return manifest, with_patients


def _write(tmp_path: Path, text: str, name: str = "recipe.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_split_keeps_each_patients_volumes_on_one_side(tmp_path, registry):
    manifest, rows = _patient_manifest(tmp_path, registry)
    patient_of = {r.path: r.patient for r in rows}
    table = f'{{ name = "dicom", path = "{manifest}" }}'
    recipe = load_recipe(_write(tmp_path, TINY_RECIPE + f"\n[[evaluator]]\nname = \"attentive-probe\"\n"
                                                        f"dataset = {table}\n"), (), registry)
    evaluator = build_components(recipe, registry, run_dir=None).evaluators[0]
    train, test = evaluator.split()
    train_patients = {patient_of[s] for s in train.sources}
    test_patients = {patient_of[s] for s in test.sources}
    assert len(train) + len(test) == 24 and not train_patients & test_patients
    fit, val = evaluator.fit_val_positions()
    assert not {patient_of[train.sources[p]] for p in fit} & {patient_of[train.sources[p]] for p in val}


def test_a_test_dataset_sharing_a_patient_with_the_train_dataset_is_refused_naming_files(tmp_path, registry):
    _manifest, rows = _patient_manifest(tmp_path, registry)
    # Volumes 10 and 11 belong to one patient: 10 on the train side, 11 on the test side.
    split = [ManifestRow(path=r.path, domain=r.domain, label=r.label, patient=r.patient,
                         split="train" if i < 11 else "test") for i, r in enumerate(rows)]
    both = tmp_path / "split.jsonl"
    write_manifest(str(both), split, relative=False)
    text = (TINY_RECIPE + "\n[[evaluator]]\nname = \"linear-probe\"\n"
            f'dataset = {{ name = "dicom", path = "{both}", split = "train" }}\n'
            f'test_dataset = {{ name = "dicom", path = "{both}", split = "test" }}\n')
    recipe = load_recipe(_write(tmp_path, text), (), registry)
    with pytest.raises(UserError, match="1 test volumes belong to patients of the train dataset") as info:
        build_components(recipe, registry, run_dir=None)
    assert rows[11].path in str(info.value) and rows[10].path in str(info.value)
    assert rows[10].patient not in str(info.value)  # files are named, never the patient key
