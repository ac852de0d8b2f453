"""``octfw bench``: a grid of settings, one subprocess per combination, a table and a CSV."""

from __future__ import annotations

import csv

import pytest

from octfw.diagnostics.bench import BenchRow, combinations, format_table, parse_grid
from octfw.display.errors import UserError


def test_grid_is_the_cartesian_product_in_order():
    grid = parse_grid(["engine.per_device_batch=1,2", "engine.grad_accum_steps=2,1",
                       "transform.image_size=[8,32,32],[4,16,16]"])
    assert grid[2] == ("transform.image_size", ["[8,32,32]", "[4,16,16]"])
    combos = combinations(grid)
    assert len(combos) == 8
    assert combos[0] == ("engine.per_device_batch=1", "engine.grad_accum_steps=2", "transform.image_size=[8,32,32]")
    assert combos[-1] == ("engine.per_device_batch=2", "engine.grad_accum_steps=1", "transform.image_size=[4,16,16]")


@pytest.mark.parametrize("spec", ["per_device_batch=1,2", "engine.per_device_batch", "engine.x=1,,2", "=1"])
def test_malformed_grid_is_a_user_error(spec):
    with pytest.raises(UserError, match="--grid"):
        parse_grid([spec])


def test_table_marks_unstable_and_failed_combinations():
    common = dict(grad_accum_steps=1, global_batch=2, samples_per_s=3.0, samples_per_s_per_device=3.0,
                  peak_memory_bytes=2 * 1024**2, peak_memory_kind="peak RSS", last_loss=0.5)
    rows = [BenchRow(overrides=("a=1",), per_device_batch=2, stable=True, skipped_updates=0, **common),
            BenchRow(overrides=("a=2",), per_device_batch=2, stable=False, skipped_updates=1, **common),
            BenchRow(overrides=("a=3",), per_device_batch=None, grad_accum_steps=None, global_batch=None,
                     samples_per_s=None, samples_per_s_per_device=None, peak_memory_bytes=None,
                     peak_memory_kind="peak RSS", stable=False, skipped_updates=None, last_loss=None,
                     error="RuntimeError: out of memory")]
    lines = format_table(rows).splitlines()
    assert "peak memory (peak RSS)" in lines[0]
    assert lines[1].endswith("ok") and "NO (1 skipped" in lines[2] and "FAILED: RuntimeError" in lines[3]


def test_bench_runs_each_combination_end_to_end(tiny_recipe, tmp_path, capsys):
    from octfw.cli.main import main

    out_csv = tmp_path / "bench.csv"
    code = main(["bench", str(tiny_recipe), "--grid", "engine.per_device_batch=1,2",
                 "--grid", "engine.grad_accum_steps=2", "--steps", "4", "--csv", str(out_csv),
                 "--set", "model.depth=1", "--set", "model.predictor_depth=1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    header, first, second = [line for line in printed.splitlines() if not line.startswith(("bench ", "written"))]
    assert header.startswith("per_device_batch  grad_accum  global_batch  samples/s  samples/s/device")
    assert first.split()[:3] == ["1", "2", "2"] and second.split()[:3] == ["2", "2", "4"]
    assert first.endswith("ok") and second.endswith("ok")
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["global_batch"] for r in rows] == ["2", "4"]
    for r in rows:
        assert float(r["samples_per_s"]) > 0 and r["samples_per_s"] == r["samples_per_s_per_device"]
        assert int(r["peak_memory_bytes"]) > 100 * 1024**2 and r["peak_memory_kind"] == "peak RSS"
        assert r["stable"] == "True" and r["skipped_updates"] == "0" and r["error"] == ""


def test_data_only_times_the_loader_per_worker_count_and_sizes_the_workers(tiny_recipe, tmp_path, capsys):
    """The real loader with 0 and 1 worker processes; the cold cache is filled first (and said), and
    the workers asked for follow from the measured rate: ceil(devices x device rate / per worker)."""
    import math

    from octfw.cli.main import main

    cache = tmp_path / "cache"
    args = ["bench", str(tiny_recipe), "--set", f"run.cache_dir={cache}", "--data-only", "--workers", "1,0",
            "--samples", "8", "--device-rate", "150", "--devices", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line[:8].strip().isdigit()}
    assert sorted(rows) == [0, 1]
    assert rows[0][3] == "-" and rows[1][4] == "MiB" and float(rows[1][3]) > 0  # a worker's own memory
    per_worker = float(rows[1][2])
    assert "cold: 0 of 8 volumes were prepared" in out and "the first pass prepared them" in out
    need = math.ceil(2 * 150 / per_worker)
    assert f"at 150 samples/s per device x 2 devices: {need} loader worker" in out

    assert main(args) == 0  # the cache is warm now: no first pass
    assert "warm: all 8 volumes prepared" in capsys.readouterr().out


@pytest.mark.parametrize("workers", ["x", "-1", ""])
def test_data_only_refuses_bad_worker_counts(tiny_recipe, capsys, workers):
    from octfw.cli.main import main

    assert main(["bench", str(tiny_recipe), "--data-only", "--workers", workers]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("octfw: error: --workers") and len(err.splitlines()) == 1


def test_the_summary_reports_the_data_wait_share_of_the_whole_run(tiny_recipe):
    import json

    from octfw.cli.main import main

    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=2"]) == 0
    [run_dir] = (tiny_recipe.parent / "runs" / "tiny").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 < summary["data_wait_share"] <= 1.0  # step 1 waits for the first batch at least
    assert max(row["data_wait_share"] for row in rows) > 0.0


def test_loader_workers_follow_the_machine_unless_the_recipe_pins_them(monkeypatch):
    import os

    from octfw.engine.data import loader_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(240)))  # a TPU v4 host
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loader_workers(None, "xla")[0] == 8  # capped: more feeds nothing on a v4 host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # 8 GPUs, 16 cores
    assert loader_workers(None, "cuda") == (1, "auto: 16 cores / 8 processes - 1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert loader_workers(None, "cuda")[0] == 0
    assert loader_workers(None, "cpu") == (0, "auto: training on the CPU uses its cores")
    assert loader_workers(3, "cpu") == (3, "engine.num_workers")


def test_a_run_says_how_many_loader_workers_it_uses_and_why(tiny_recipe, caplog):
    import logging

    from octfw.cli.main import main

    with caplog.at_level(logging.INFO, logger="octfw.engine.trainer"):
        assert main(["run", str(tiny_recipe), "--set", "run.max_steps=1", "--set", "engine.num_workers=1"]) == 0
    assert "data loader: 1 worker per process (engine.num_workers)" in caplog.text
