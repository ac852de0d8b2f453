"""What ``octfw run`` exits with: one table for the CLI, the launcher and the docs.

A job scheduler's requeue logic reads these, so every process of a job exits
with the same code for the same outcome (the decision behind it is shared,
see :mod:`octfw.engine.distributed`), and ``octfw run --nproc-per-node``
exits with that code, not the 1 that torchrun reports for any failure.
"""

from __future__ import annotations

__all__ = ["FINISHED", "STOPPED_BY_GUARD", "CRASHED", "USER_ERROR", "SAVE_FAILED_EXIT_CODE", "PREEMPTED_EXIT_CODE",
           "PEER_LOST_EXIT_CODE", "INTERRUPTED_EXIT_CODE", "BROKEN_PIPE_EXIT_CODE", "RETRY_CODES", "describe"]

#: The run finished (or a guard ended it at a target reached), or ``--resume auto`` found it finished.
FINISHED = 0
#: A guard or logger stopped the run for a problem (the collapse guard, too many skipped updates).
STOPPED_BY_GUARD = 1
#: A bug: an exception octfw did not expect, on any process of the job (its traceback is printed by
#: that process alone). Never retried: running it again meets the same bug.
CRASHED = 1
#: A user mistake: a bad recipe, a missing file, an unknown component. Nothing was trained.
USER_ERROR = 2
#: The final checkpoint could not be written (EX_IOERR): the state is in RUN_DIR/fallback/ if that
#: could be written; resume once the checkpoint location works again.
SAVE_FAILED_EXIT_CODE = 74
#: Stopped by SIGTERM/SIGINT or a TPU preemption notice, with the state saved (EX_TEMPFAIL: "try
#: again later", which is what a scheduler should do).
PREEMPTED_EXIT_CODE = 75
#: A process of the job vanished, was killed by a signal (an out-of-memory kill, a kill -9) or stopped
#: answering within ``engine.collective_timeout_s`` (EX_PROTOCOL): nothing after the newest checkpoint
#: was saved; run the job again with ``--resume auto``. Never a process's own error: that is 1, 2 or 74.
PEER_LOST_EXIT_CODE = 76
#: Stopped at once by a second Ctrl-C, without the final save (128 + SIGINT, as shells report it).
INTERRUPTED_EXIT_CODE = 130
#: The reader of stdout went away (``octfw list | head -2``): 128 + SIGPIPE, what a shell reports
#: for a command the closed pipe ended.
BROKEN_PIPE_EXIT_CODE = 141

#: The codes after which running the same command with ``--resume auto`` is the right thing to do.
RETRY_CODES = (PREEMPTED_EXIT_CODE, PEER_LOST_EXIT_CODE)

_MEANING = {
    FINISHED: "finished",
    STOPPED_BY_GUARD: "stopped by a guard, or a crash",
    USER_ERROR: "a user mistake",
    SAVE_FAILED_EXIT_CODE: "the final checkpoint could not be written",
    PREEMPTED_EXIT_CODE: "preempted, state saved",
    PEER_LOST_EXIT_CODE: "a process of the job was lost",
    INTERRUPTED_EXIT_CODE: "stopped at once by a second Ctrl-C",
    BROKEN_PIPE_EXIT_CODE: "the reader of its output went away",
}


def describe(code: int) -> str:
    """``75 (preempted, state saved)``; a signal death (negative, as subprocess reports it) by name."""
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"{code} ({_MEANING[code]})" if code in _MEANING else f"exit code {code}"
