"""The console and jsonl loggers."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from octfw.plugins.loggers.console import ConsoleConfig, ConsoleLogger
from octfw.plugins.loggers.console import build as build_console
from octfw.plugins.loggers.jsonl import JsonlConfig
from octfw.plugins.loggers.jsonl import build as build_jsonl
from octfw.types import BuildContext, Logger

CTX = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0)

METRICS = {
    "loss": 0.1234,
    "lr": 1e-4,
    "grad_norm": 0.53,
    "skipped_updates": 0,
    "samples_per_s": 12.34,
    "loss/heidelberg": 0.2,  # per-domain: not shown on the console
    "ema_momentum": 0.997,
}


# --- console --------------------------------------------------------------


def test_console_plain_prints_one_line_per_log_step(capsys, tmp_path):
    logger = build_console(ConsoleConfig(mode="plain"), CTX)
    assert isinstance(logger, Logger)
    logger.start(60, tmp_path, {})
    logger.log(10, METRICS)
    logger.log(20, {"loss": float("nan"), "lr": 9e-5})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 10/60 loss 0.1234 lr 1.00e-04 grad_norm 0.53 skipped 0 samples/s 12.3",
        "step 20/60 loss nan lr 9.00e-05",
    ]


def test_console_small_loss_is_not_printed_as_zero(capsys, tmp_path):
    logger = ConsoleLogger(mode="plain")
    logger.start(60, tmp_path, {})
    logger.log(1, {"loss": 2.5e-6})
    assert capsys.readouterr().out.strip() == "step 1/60 loss 2.500e-06"


def test_console_auto_is_plain_when_stdout_is_not_a_terminal(capsys, tmp_path):
    logger = build_console(ConsoleConfig(), CTX)
    logger.start(60, tmp_path, {})
    logger.log(2, {"loss": 1.0})
    assert capsys.readouterr().out == "step 2/60 loss 1.0000\n"


def test_console_summary_renders_present_keys(capsys, tmp_path):
    logger = ConsoleLogger(mode="plain")
    logger.start(60, tmp_path, {})
    logger.finish({
        "update_steps": 60,
        "first_loss": 0.9,
        "last_loss": 0.1234,
        "skipped_updates": 2,
        "samples_per_s": 12.34,
        "elapsed_s": 3723,
        "checkpoint": "/runs/a/checkpoints/step_00000060.pt",
        "failed_saves": ["step 40: OSError: disk full"],
        "quarantined": [f"/data/bad_{i}.dcm: truncated pixel data" for i in range(7)],
        "wandb_url": None,
        "domains": 3,
    })
    out = capsys.readouterr().out
    assert out.startswith("training summary\n")
    assert "steps            60/60" in out
    assert "0.9000 -> 0.1234 (first -> last)" in out
    assert "skipped updates  2" in out
    assert "throughput       12.3 samples/s" in out
    assert "elapsed          1h 02m 03s" in out
    assert "checkpoint       /runs/a/checkpoints/step_00000060.pt" in out
    assert "1 failed" in out and "- step 40: OSError: disk full" in out
    assert "7 files" in out and "bad_4.dcm" in out and "bad_5.dcm" not in out and "... and 2 more" in out
    assert "domains" in out
    assert "None" not in out


def test_console_summary_skips_missing_keys(capsys, tmp_path):
    logger = ConsoleLogger(mode="plain")
    logger.start(10, tmp_path, {})
    logger.finish({"update_steps": 4, "stopped": "StopTraining: grad_norm exploded"})
    out = capsys.readouterr().out
    assert "steps            4/10" in out
    assert "stopped          StopTraining: grad_norm exploded" in out
    for absent in ("loss ", "throughput", "checkpoint", "quarantined", "failed saves"):
        assert absent not in out


def test_console_bar_shows_progress_and_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # rich's width for a stream that is not a terminal
    stream = io.StringIO()
    logger = ConsoleLogger(mode="bar", stream=stream)
    logger.start(60, tmp_path, {})
    logger.log(30, METRICS)
    logger.finish({"update_steps": 30})
    out = stream.getvalue()
    assert "30/60" in out
    assert "loss 0.1234" in out and "grad_norm 0.53" in out and "samples/s 12.3" in out
    assert "training summary" in out


# --- jsonl ----------------------------------------------------------------


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_writes_one_parsable_line_per_log_step(tmp_path):
    logger = build_jsonl(JsonlConfig(), CTX)
    assert isinstance(logger, Logger)
    logger.start(60, tmp_path, {})
    logger.log(2, {"loss": np.float32(0.5), "skipped_updates": 1, "lr": 1e-4})
    # line-buffered: the line is in the file before finish(), as after a crash
    assert read_lines(tmp_path / "metrics.jsonl")[0]["step"] == 2
    logger.log(4, {"loss": 0.25})
    logger.finish({})
    first, second = read_lines(tmp_path / "metrics.jsonl")
    assert list(first)[0] == "step" and list(first)[-1] == "time"
    assert first["loss"] == 0.5 and first["skipped_updates"] == 1 and first["lr"] == 1e-4
    assert "nonfinite" not in first
    assert second["step"] == 4 and first["time"] <= second["time"]


def test_jsonl_nonfinite_values_are_null_and_listed(tmp_path):
    logger = build_jsonl(JsonlConfig(filename="m.jsonl"), CTX)
    logger.start(60, tmp_path, {})
    logger.log(6, {"loss": float("nan"), "grad_norm": math.inf, "lr": 1e-4})
    logger.finish({})
    text = (tmp_path / "m.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (record,) = read_lines(tmp_path / "m.jsonl")
    assert record["loss"] is None and record["grad_norm"] is None
    assert record["nonfinite"] == ["loss", "grad_norm"]
    assert record["lr"] == 1e-4


def test_jsonl_appends_on_resume(tmp_path):
    for step in (2, 4):
        logger = build_jsonl(JsonlConfig(), CTX)
        logger.start(60, tmp_path, {})
        logger.log(step, {"loss": 1.0})
        logger.finish({})
    assert [r["step"] for r in read_lines(tmp_path / "metrics.jsonl")] == [2, 4]


def test_jsonl_refuses_reserved_metric_names_and_bad_filenames(tmp_path):
    logger = build_jsonl(JsonlConfig(), CTX)
    logger.start(60, tmp_path, {})
    with pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"time": 3.0})
    logger.finish({})
    with pytest.raises(ValueError, match="file name"):
        JsonlConfig(filename="../escape.jsonl")


def test_console_prints_evaluator_results_on_their_own_line():
    import io

    from octfw.plugins.loggers.console import ConsoleLogger

    stream = io.StringIO()
    logger = ConsoleLogger(mode="plain", stream=stream)
    logger.start(10, Path("."), {})
    logger.on_step(3)  # plain mode: nothing to move
    logger.log(10, {"eval/linear-probe/accuracy": 0.875, "eval/knn/accuracy": 0.75})
    assert stream.getvalue() == "eval at step 10: knn/accuracy 0.75 linear-probe/accuracy 0.875\n"


def test_summary_shows_skipped_saves_and_the_resume_hint_only_when_they_apply():
    from octfw.plugins.loggers.console import format_summary

    quiet = format_summary({"update_steps": 4, "total_update_steps": 4, "skipped_saves": 0, "preempted": False})
    assert "skipped saves" not in quiet and "preempted" not in quiet
    busy = format_summary({"update_steps": 7, "total_update_steps": 40, "skipped_saves": 3, "preempted": True,
                           "stopped": "SIGTERM at update step 7"})
    assert "skipped saves    3 (the previous save was still being written)" in busy
    assert "stopped          SIGTERM at update step 7; resume with --resume auto" in busy


def test_summary_says_a_failed_final_save_and_where_the_state_went_only_when_it_happened():
    from octfw.plugins.loggers.console import format_summary

    fine = format_summary({"update_steps": 4, "interrupted": False, "final_save_failed": False,
                           "fallback_checkpoint": None})
    assert "final save" not in fine and "interrupted" not in fine and "fallback" not in fine
    failed = format_summary({"update_steps": 4, "final_save_failed": True,
                             "fallback_checkpoint": "runs/x/fallback/step_00000004.pt"})
    assert "final save       FAILED; the final state is in runs/x/fallback/step_00000004.pt" in failed
    lost = format_summary({"update_steps": 4, "final_save_failed": True, "fallback_checkpoint": None})
    assert "FAILED; no fallback copy could be written" in lost
    at_once = format_summary({"update_steps": 7, "preempted": True, "interrupted": True, "stopped": "SIGINT at update step 7"})
    assert "SIGINT at update step 7 (at once: no final save); resume with --resume auto" in at_once


def test_console_summary_says_the_data_wait_share_once_and_hints_at_workers_when_it_is_high(capsys, tmp_path):
    logger = ConsoleLogger(mode="plain")
    logger.start(10, tmp_path, {})
    logger.finish({"update_steps": 10, "data_wait_share": 0.05})
    out = capsys.readouterr().out
    assert "data wait        5% of the run\n" in out and "data_wait_share" not in out
    logger.start(10, tmp_path, {})
    logger.finish({"update_steps": 10, "data_wait_share": 0.6, "elapsed_s": 600.0})
    assert "60% of the run (the loader limits training: more engine.num_workers" in capsys.readouterr().out


def test_the_data_wait_hint_stays_quiet_in_a_run_too_short_for_workers_to_pay_off(capsys, tmp_path):
    """The quickstart's few seconds: 22 % of them is no reason to start loader workers."""
    logger = ConsoleLogger(mode="plain")
    logger.start(60, tmp_path, {})
    logger.finish({"update_steps": 60, "data_wait_share": 0.22, "elapsed_s": 2.0})
    out = capsys.readouterr().out
    assert "data wait        22% of the run\n" in out and "num_workers" not in out
