"""Signals and the batch a recipe keeps, in this process: real signals sent to the test's own
process through each phase of a run, the launcher's forwarded repeat, torch_xla's SIGTERM left to
torch_xla, and ``engine.global_batch`` on the devices found."""

from __future__ import annotations

import os
import signal
import time

import pytest

from octfw.engine.distributed import layout_for
from octfw.engine.preemption import StopNow, StoppedBeforeTraining, StopRequests
from octfw.display.errors import UserError
from octfw.cli.exit_codes import describe


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_a_signal_while_starting_abandons_the_start():
    with StopRequests(duplicate_window_s=0) as stops:
        with pytest.raises(StoppedBeforeTraining, match="stopped by SIGTERM before training began; nothing to save"):
            _signal_self(signal.SIGTERM)
        assert stops.signals == 1


def test_training_the_first_signal_is_a_request_the_second_stops_inside_the_step():
    with StopRequests(duplicate_window_s=0) as stops:
        stops.start_training("cpu")
        _signal_self(signal.SIGTERM)
        assert stops.local_vote(3) == 1 and not stops.stop_now and stops.signal_name == "SIGTERM"
        with pytest.raises(StopNow):
            _signal_self(signal.SIGINT)
        assert stops.stop_now and stops.local_vote(3) == 2


def test_closing_a_second_signal_cancels_the_final_save_without_raising():
    with StopRequests(duplicate_window_s=0) as stops:
        stops.start_training("cpu")
        _signal_self(signal.SIGTERM)
        stops.closing()
        _signal_self(signal.SIGTERM)
        assert stops.stop_now


def test_a_repeat_within_the_window_is_the_launcher_forwarding_it_counted_once():
    with StopRequests(duplicate_window_s=5.0) as stops:
        stops.start_training("cpu")
        _signal_self(signal.SIGTERM)
        _signal_self(signal.SIGTERM)  # torchrun (or srun, or octfw's launcher) forwarding the same signal
        assert stops.signals == 1 and not stops.stop_now
        with pytest.raises(StopNow):
            _signal_self(signal.SIGINT)  # another signal is a second request


def test_after_the_run_ended_signals_are_ignored():
    with StopRequests(duplicate_window_s=0) as stops:
        stops.start_training("cpu")
        stops.done()
        _signal_self(signal.SIGTERM)
        assert stops.signals == 0


def test_the_handlers_of_before_come_back_after_a_single_process_run():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests(duplicate_window_s=0) as stops:
        stops.start_training("cpu")
        stops.done()
    assert signal.getsignal(signal.SIGTERM) is before


def test_where_torch_xla_owns_sigterm_octfw_never_installs_its_own_over_it():
    """On a TPU the preemption sync manager's C++ handler holds SIGTERM; leaving the run must not
    put a Python handler back over it (the sync manager is only active on a TPU, so its flag is
    set here as start_training sets it there)."""
    sentinel = signal.getsignal(signal.SIGTERM)
    stops = StopRequests(duplicate_window_s=0)
    with stops:
        stops._xla_sync = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what the C++ sigaction left, seen from Python
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal.signal(signal.SIGTERM, sentinel)


def test_on_the_cpu_the_sync_manager_is_not_activated_and_sigterm_stays_octfws():
    with StopRequests(duplicate_window_s=0) as stops:
        stops.start_training("cpu")
        assert not stops._xla_sync and signal.getsignal(signal.SIGTERM) == stops._on_signal


def test_a_pinned_global_batch_derives_the_micro_steps_from_the_devices():
    assert layout_for(1, 1, 32, processes=16).grad_accum_steps == 2  # the seeds' TPU v4-32
    one_cpu = layout_for(1, 1, 32)
    assert (one_cpu.grad_accum_steps, one_cpu.global_batch) == (32, 32)
    assert layout_for(1, 1, 32, processes=4, devices_per_process=4).global_batch == 32
    assert layout_for(2, 3, None, processes=2).global_batch == 12  # not pinned: as the recipe says


def test_a_global_batch_that_does_not_divide_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"engine.global_batch = 32 does not divide over 3 devices x "
                                        r"engine.per_device_batch 1 = 3 samples per micro-step"):
        layout_for(1, 1, 32, processes=3)


def test_a_recipe_cannot_pin_both_the_global_batch_and_the_micro_steps(write_recipe, registry):
    from octfw.recipe import load_recipe

    from conftest import TINY_RECIPE

    path = write_recipe(TINY_RECIPE)
    with pytest.raises(UserError, match="set engine.global_batch .* or engine.grad_accum_steps .*, not both"):
        load_recipe(path, ["engine.global_batch=8", "engine.grad_accum_steps=2"], registry)
    with pytest.raises(UserError, match="collective_timeout_s .* must exceed engine.save_deadline_s"):
        load_recipe(path, ["engine.collective_timeout_s=10", "engine.save_deadline_s=15"], registry)


def test_check_says_the_global_batch_that_will_run_and_one_update_steps_time(tiny_recipe, capsys):
    from octfw.cli.main import main

    assert main(["check", str(tiny_recipe), "--set", "engine.global_batch=8"]) == 0
    out = capsys.readouterr().out
    assert "layout    global batch 8 = per_device_batch 2 x 1 device x grad_accum_steps 4" in out
    [line] = [line for line in out.splitlines() if line.startswith("step time")]
    assert line.startswith("step time engine.global_batch = 8 kept on 1 device: 4 micro-steps of per_device_batch 2 "
                           "per update step; one update step about ") and line.endswith("on this CPU")


def test_run_says_what_one_update_step_takes_when_the_global_batch_is_pinned(tiny_recipe, tmp_path, capsys):
    from octfw.cli.main import main

    code = main(["run", str(tiny_recipe), "--set", f"run.output_dir={tmp_path}", "--set", "engine.global_batch=4",
                 "--set", "run.max_steps=2"])
    assert code == 0
    err = capsys.readouterr().err
    assert "octfw: warning: engine.global_batch = 4 kept on 1 device: 2 micro-steps of per_device_batch 2 per " \
           "update step; one update step about" in err


def test_exit_codes_read_as_words():
    assert describe(75) == "75 (preempted, state saved)"
    assert describe(-9) == "killed by SIGKILL"
    assert describe(3) == "exit code 3"
