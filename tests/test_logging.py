"""One line per warning on the console; tracebacks and library chatter in the run's octfw.log."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from pathlib import Path

from conftest import TINY_RECIPE
from octfw.cli.main import main
from octfw.display.logs import LOG_FILE, THIRD_PARTY_LEVELS, attach_run_log, detach_run_log, setup_console_logging

REPO = Path(__file__).resolve().parents[1]
FAILED_SAVE = "checkpoint at update step 4 failed, training goes on: StorageError: upload failed after 2 attempts"


@contextlib.contextmanager
def console_on_root():
    """A stderr handler on the root logger, as ``logging.basicConfig()`` in a program
    around octfw installs: a library record that propagated would show on stderr."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def handlers_of(name: str) -> list[logging.Handler]:
    return list(logging.getLogger(name).handlers)


def fail_to_upload() -> None:
    """What gcsfs does when the store is down: a traceback through its logger."""
    log = logging.getLogger("gcsfs")
    log.debug("_call retrying after exception: Cannot connect to host storage:443")
    try:
        raise ConnectionRefusedError("Cannot connect to host storage:443")
    except ConnectionRefusedError as exc:
        log.exception(f"_call out of retries on exception: {exc}")


def test_setting_up_twice_keeps_one_console_handler():
    before = len(handlers_of("octfw"))
    first = setup_console_logging()
    second = setup_console_logging(debug=True)
    try:
        assert second is first
        assert len(handlers_of("octfw")) == before  # the test session set it up already
        assert [h.get_name() for h in handlers_of("octfw")].count("octfw-console") == 1
        assert first.level == logging.DEBUG
    finally:
        setup_console_logging()
    assert first.level == logging.INFO


def test_a_library_traceback_goes_to_the_run_log_and_not_to_the_console(tmp_path, capsys):
    with console_on_root():
        handler = attach_run_log(tmp_path)
        try:
            fail_to_upload()
        finally:
            detach_run_log(handler)
    assert capsys.readouterr().err == ""
    text = (tmp_path / LOG_FILE).read_text()
    assert "ERROR    gcsfs [MainThread]: _call out of retries on exception: Cannot connect" in text
    assert "Traceback (most recent call last)" in text and "ConnectionRefusedError" in text
    assert "DEBUG    gcsfs [MainThread]: _call retrying after exception" in text  # the retry chatter


def test_an_octfw_warning_is_one_console_line_and_in_the_run_log_with_its_traceback(tmp_path, capsys):
    handler = attach_run_log(tmp_path)
    try:
        try:
            raise OSError("store unreachable")
        except OSError:
            logging.getLogger("octfw.engine.trainer").warning(FAILED_SAVE, exc_info=True)
    finally:
        detach_run_log(handler)
    assert capsys.readouterr().err.splitlines() == [f"octfw: warning: {FAILED_SAVE}"]
    text = (tmp_path / LOG_FILE).read_text()
    assert f"WARNING  octfw.engine.trainer [MainThread]: {FAILED_SAVE}" in text
    assert "OSError: store unreachable" in text


def test_console_lines_by_level_and_debug_shows_tracebacks(capsys):
    log = logging.getLogger("octfw.test_logging")
    log.info("dataset: 6 samples in 3 domains")
    log.error("broken")
    log.warning("stalled", extra={"octfw_label": "octfw heartbeat"})
    log.debug("hidden")
    assert capsys.readouterr().err.splitlines() == [
        "dataset: 6 samples in 3 domains", "octfw: error: broken", "octfw heartbeat: stalled"]
    setup_console_logging(debug=True)
    try:
        try:
            raise ValueError("why")
        except ValueError:
            log.warning("with traceback", exc_info=True)
        log.debug("shown")
    finally:
        setup_console_logging()
    err = capsys.readouterr().err
    assert err.startswith("octfw: warning: with traceback\nTraceback") and "ValueError: why" in err
    assert err.splitlines()[-1] == "octfw: debug: shown"


def test_detaching_removes_the_file_handler_and_gives_libraries_back_their_settings(tmp_path, capsys):
    names = ["octfw", *THIRD_PARTY_LEVELS]
    before = {name: (handlers_of(name), logging.getLogger(name).level, logging.getLogger(name).propagate)
              for name in names}
    handler = attach_run_log(tmp_path)
    assert all(handler in handlers_of(name) for name in names)
    assert logging.getLogger("gcsfs").propagate is False
    detach_run_log(handler)
    after = {name: (handlers_of(name), logging.getLogger(name).level, logging.getLogger(name).propagate)
             for name in names}
    assert after == before
    size = (tmp_path / LOG_FILE).stat().st_size
    logging.getLogger("octfw.engine.trainer").warning("after the run")
    assert (tmp_path / LOG_FILE).stat().st_size == size
    capsys.readouterr()


def test_attaching_again_replaces_a_run_log_left_attached(tmp_path):
    levels = {name: logging.getLogger(name).level for name in ["octfw", *THIRD_PARTY_LEVELS]}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = attach_run_log(tmp_path / "a")
    second = attach_run_log(tmp_path / "b")
    try:
        assert first not in handlers_of("octfw") and first not in handlers_of("gcsfs")
        assert [h.get_name() for h in handlers_of("octfw")].count("octfw-run-log") == 1
        logging.getLogger("octfw.x").info("to b only")
    finally:
        detach_run_log(second)
    assert "to b only" not in (tmp_path / "a" / LOG_FILE).read_text()
    assert "to b only" in (tmp_path / "b" / LOG_FILE).read_text()
    assert {name: logging.getLogger(name).level for name in levels} == levels


def test_a_failed_save_under_octfw_is_one_line_on_stderr(tmp_path):
    # A fresh process set up as `octfw` sets it up: no root handler, so Python's
    # last-resort handler would print what no other handler takes.
    code = f"""
import logging, sys
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
from octfw.display.logs import attach_run_log, detach_run_log, setup_console_logging
from test_logging import FAILED_SAVE, fail_to_upload

setup_console_logging()
handler = attach_run_log({str(tmp_path)!r})
fail_to_upload()
logging.getLogger("asyncio").error("Unclosed client session")
logging.getLogger("octfw.engine.trainer").warning(FAILED_SAVE)
detach_run_log(handler)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"octfw: warning: {FAILED_SAVE}"] and done.stdout == ""
    text = (tmp_path / LOG_FILE).read_text()
    assert "Traceback" in text and "Unclosed client session" in text and FAILED_SAVE in text


def test_a_run_writes_its_warnings_to_octfw_log_and_leaves_no_handler_behind(write_recipe, tmp_path, capsys):
    console = handlers_of("octfw")
    path = write_recipe(TINY_RECIPE + '\n[[guard]]\nname = "collapse"\nmin_std = 0.9\npatience = 1\n')
    assert main(["run", str(path), "--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "run.max_steps=2"]) == 0
    err = capsys.readouterr().err
    assert "octfw: warning: collapse: metric/target_std" in err
    [run_dir] = (tmp_path / "runs" / "recipe").iterdir()
    text = (run_dir / LOG_FILE).read_text()
    assert "WARNING  octfw.plugins.guards.collapse [MainThread]: collapse: metric/target_std" in text
    assert handlers_of("octfw") == console
    assert not any(h.get_name() == "octfw-run-log" for name in THIRD_PARTY_LEVELS for h in handlers_of(name))
