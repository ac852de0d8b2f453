"""The background saver's rules: one save in flight, skips, failures reported once, the final deadline."""

from __future__ import annotations

import logging
import threading
import time

from octfw.engine.checkpointing import BackgroundSaver


class GatedCheckpointer:
    """Writes only when the test opens its gate; fails on the steps it is told to."""

    def __init__(self, fail_at: tuple[int, ...] = ()):
        self.gate = threading.Event()
        self.saved: list[int] = []
        self.fail_at = fail_at

    def save(self, update_step: int, state: dict) -> str:
        self.gate.wait(30)
        if update_step in self.fail_at:
            raise OSError(f"store unreachable at step {update_step}")
        self.saved.append(update_step)
        return f"ckpt/{update_step}"


def test_a_save_due_while_one_is_in_flight_is_skipped_without_copying_the_state():
    checkpointer = GatedCheckpointer()
    saver = BackgroundSaver(checkpointer)
    copies: list[int] = []
    assert saver.submit(2, lambda: copies.append(2) or {"step": 2})
    assert not saver.submit(4, lambda: copies.append(4) or {"step": 4})  # step 2 still being written
    assert copies == [2] and saver.skipped == [4]
    checkpointer.gate.set()
    assert saver.wait(10) and saver.latest == "ckpt/2"
    assert saver.submit(6, lambda: {"step": 6}) and saver.wait(10)
    assert checkpointer.saved == [2, 6] and saver.latest == "ckpt/6"
    # the skipped one is a save that did not happen: counted with the failed ones
    assert saver.failed == ["step 4: not written: the save of update step 2 was still being written (a slow store)"]


def test_a_failed_save_is_reported_once_and_the_last_good_checkpoint_stays(caplog):
    checkpointer = GatedCheckpointer(fail_at=(4,))
    checkpointer.gate.set()
    saver = BackgroundSaver(checkpointer)
    with caplog.at_level(logging.WARNING, logger="octfw.engine.checkpointing"):
        for step in (2, 4):
            saver.submit(step, lambda: {})
            assert saver.wait(10)
        saver.poll()
    assert saver.latest == "ckpt/2"
    assert saver.failed == ["step 4: OSError: store unreachable at step 4"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "update step 4 failed, training goes on" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None  # the traceback goes to octfw.log, not the console line


def test_the_final_save_waits_for_the_one_in_flight_then_writes_its_own():
    checkpointer = GatedCheckpointer()
    saver = BackgroundSaver(checkpointer)
    saver.submit(10, lambda: {})
    threading.Timer(0.2, checkpointer.gate.set).start()
    saver.save_final(12, lambda: {}, deadline_s=10)
    assert checkpointer.saved == [10, 12] and saver.latest == "ckpt/12" and saver.failed == []


def test_the_final_save_reuses_a_periodic_save_of_the_same_step():
    checkpointer = GatedCheckpointer()
    checkpointer.gate.set()
    saver = BackgroundSaver(checkpointer)
    saver.submit(12, lambda: {})
    saver.save_final(12, lambda: {}, deadline_s=10)
    assert checkpointer.saved == [12] and saver.latest == "ckpt/12"


def test_the_final_save_gives_up_at_its_deadline():
    checkpointer = GatedCheckpointer()  # the gate never opens: a store that hangs
    saver = BackgroundSaver(checkpointer)
    saver.submit(10, lambda: {})
    started = time.monotonic()
    saver.save_final(12, lambda: {}, deadline_s=0.3)
    assert time.monotonic() - started < 5
    assert saver.latest is None and checkpointer.saved == []
    assert saver.failed == ["step 12: not written: the save of update step 10 was still being written after 0.3 s "
                            "(a slow store)"]
    checkpointer.gate.set()  # let the daemon thread end
