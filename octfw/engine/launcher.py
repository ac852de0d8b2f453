"""``octfw run RECIPE --nproc-per-node N``: one node's training processes, one job.

The processes are started and watched by torch.distributed's elastic agent,
the engine torchrun uses (rendezvous, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``,
the job's store), with no restarts: a failed process ends the job, and
``--resume auto`` continues it. What octfw adds around the agent:

- **One line for the job.** Every worker writes its final line into a folder
  of the launcher's (:data:`octfw.commands.run.JOB_STATUS_ENV`); the launcher
  prints rank 0's (else the lowest rank's), and only rank 0's log reaches the
  console while training. The agent's own INFO lines stay off the console.
- **octfw's exit codes**, not torchrun's 1 for any failure: rank 0's code
  (every process ends the same way: the decision behind it is shared), else
  :data:`~octfw.exit_codes.PEER_LOST_EXIT_CODE` when a process died.
- **Signals forwarded once.** SIGTERM and SIGINT received by the launcher go
  to every worker as they came (Kubernetes stops a pod with a SIGTERM to its
  first process only); a worker counts a repeat that the process group had
  already delivered once (:data:`octfw.engine.preemption.DUPLICATE_WINDOW_S`).
  A third Ctrl-C kills the workers (SIGKILL) and exits 130.
- **No unbounded wait.** The rendezvous of the nodes waits at most
  ``engine.collective_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from octfw.errors import UserError, one_line
from octfw.exit_codes import FINISHED, PEER_LOST_EXIT_CODE, describe

__all__ = ["launch_job", "processes_per_node", "JOB_STATUS_ENV"]

log = logging.getLogger(__name__)

#: Set for the workers: the folder where each writes its final line (exit code, then the line), so
#: that the launcher prints one line for the job instead of one per process.
JOB_STATUS_ENV = "OCTFW_JOB_STATUS_DIR"

#: Seconds a process needs, beyond the collective timeout, to name a lost peer and end (the liveness
#: census, the newest checkpoint read back, the interpreter's exit).
LOST_PEER_REPORT_S = 20.0
#: The codes an octfw worker exits with on purpose: rank 0's is the job's.
_OCTFW_CODES = {0, 1, 2, 74, 75, 76, 130}


def processes_per_node(requested: str, device_kind: str) -> int:
    """``N`` or ``auto`` (one per visible GPU; one process on a machine without)."""
    if requested != "auto":
        try:
            count = int(requested)
        except ValueError:
            count = 0
        if count < 1:
            raise UserError(f"--nproc-per-node {requested!r}: give a whole number of processes (>= 1) or 'auto'")
        return count
    if device_kind == "cuda":
        import torch

        return max(torch.cuda.device_count(), 1)
    if device_kind == "xla":
        raise UserError("--nproc-per-node: on a TPU one process per host drives all of its chips (XLA SPMD); "
                        "run `octfw run` once per host (docs/tpu-pods.md)")
    return 1


def launch_job(worker_argv: list[str], recipe: Any, *, nproc_per_node: str, nnodes: int = 1,
               rdzv_endpoint: str | None = None, rdzv_id: str | None = None, resume_command: str = "") -> int:
    """Run ``octfw <worker_argv>`` in ``nproc_per_node`` processes of a job of ``nnodes`` nodes
    and wait for them; the job's exit code (see the module docstring)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rendezvous_registry

    from octfw.engine.backend import resolve_device

    nproc = processes_per_node(nproc_per_node, resolve_device(recipe.run.device))
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, the same on every node "
                        "(the first node's address and a free port)")
    _quiet_agent_logs()
    timeout_s = recipe.engine.collective_timeout_s
    parameters = RendezvousParameters(
        backend="c10d", endpoint=rdzv_endpoint or "localhost:0",
        run_id=rdzv_id or (recipe.name if nnodes > 1 else str(uuid.uuid4())),
        min_nodes=nnodes, max_nodes=nnodes, join_timeout=str(int(timeout_s)))
    status_dir = Path(tempfile.mkdtemp(prefix="octfw-job-"))
    os.environ[JOB_STATUS_ENV] = str(status_dir)  # the workers inherit it
    spec = WorkerSpec(role="octfw", local_world_size=nproc, entrypoint=sys.executable,
                      args=("-m", "octfw.cli", *worker_argv),
                      rdzv_handler=rendezvous_registry.get_rendezvous_handler(parameters),
                      max_restarts=0, monitor_interval=0.1)
    agent = _Agent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(status_dir / "agent")),
                   forwarder=_SignalForwarder(), grace_s=timeout_s + LOST_PEER_REPORT_S)
    log.info("job: %s on this node%s", _processes(nproc),
             f", {nnodes} nodes meeting at {rdzv_endpoint}" if nnodes > 1 else "")
    try:
        result = agent.run()
    except Exception as exc:  # noqa: BLE001 - the rendezvous timed out or a node left: one line
        detail = (str(exc).strip().splitlines() or [""])[0]
        log.debug("the job's rendezvous failed", exc_info=exc)
        print(f"octfw: error: the job's processes could not start: not all {nnodes} nodes met at "
              f"{rdzv_endpoint or 'this node'} within engine.collective_timeout_s = {timeout_s:g} s "
              f"({type(exc).__name__}{': ' + one_line(detail) if detail else ''})", file=sys.stderr)
        return PEER_LOST_EXIT_CODE
    finally:
        agent.forwarder.uninstall()
        # Close the rendezvous as torchrun does: its store thread left running at exit would end the
        # launcher in std::terminate ("terminate called without an active exception", SIGABRT).
        try:
            spec.rdzv_handler.shutdown()
        except Exception as exc:  # noqa: BLE001 - the job's outcome is known; this is tidying up
            log.debug("closing the rendezvous failed", exc_info=exc)
    if result is None:  # the rendezvous closed: another node ended the job
        result_codes: dict[int, int] = {}
        succeeded = False
    else:
        succeeded = result.state == WorkerState.SUCCEEDED
        result_codes = {rank: failure.exitcode for rank, failure in result.failures.items()}
    codes = {**agent.exit_codes(), **result_codes}
    code, line = _job_outcome(codes, succeeded, status_dir, resume_command)
    if line:
        print(line, file=sys.stderr)
    return code


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _job_outcome(codes: dict[int, int], succeeded: bool, status_dir: Path, resume_command: str) -> tuple[int, str]:
    """(the job's exit code, its one line) from every local worker's exit code and final line."""
    lines = {int(p.stem.removeprefix("rank")): p.read_text(encoding="utf-8").split("\n", 1)
             for p in status_dir.glob("rank*.txt")}
    if succeeded and not lines:
        return FINISHED, ""
    if lines:  # rank 0's line, else the lowest rank's: the job's outcome as a worker saw it
        code_text, line = lines[min(lines)]
        return int(code_text), line.strip()
    # No worker could say it: a process died (a signal, an out-of-memory kill) or crashed.
    died = sorted((rank, code) for rank, code in codes.items() if code not in _OCTFW_CODES)
    if died:
        rank, code = died[0]
        return PEER_LOST_EXIT_CODE, (f"octfw: error: the process of rank {rank} ended with {describe(code)}; the "
                                     f"job stopped, and nothing after its newest checkpoint is saved. "
                                     f"Run again: {resume_command}")
    return min(codes.items())[1] if codes else PEER_LOST_EXIT_CODE, ""


def _quiet_agent_logs() -> None:
    """The agent's lines (launch configs, rendezvous rounds, "failed (exitcode: 75)") are not the
    user's business: the job's one line says how it ended."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


class _SignalForwarder:
    """The launcher's SIGTERM/SIGINT handler: each signal goes to every worker once, as it came."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.received = 0
        self._previous: dict[int, Any] = {}

    def install(self, pids: list[int]) -> None:
        """Over the agent's handler (which would raise, close the workers with a second SIGTERM
        and lose the first one's clean stop)."""
        self.pids = pids
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._forward)

    def uninstall(self) -> None:
        """The job is over: the launcher ignores signals while it says how it ended."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()

    def _forward(self, signum: int, frame: Any) -> None:
        self.received += 1
        if signum == signal.SIGINT and self.received >= 3:  # the way out of anything
            for pid in self.pids:
                _kill(pid, signal.SIGKILL)
            raise KeyboardInterrupt
        for pid in self.pids:
            _kill(pid, signum)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _agent_class() -> Any:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        """torch's local agent, with octfw's signal forwarding once its workers run."""

        def __init__(self, spec: Any, logs_specs: Any, forwarder: _SignalForwarder, grace_s: float):
            super().__init__(spec, logs_specs=logs_specs)
            self.forwarder, self.grace_s, self.grace_given = forwarder, grace_s, False

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            pids = super()._start_workers(worker_group)
            self.forwarder.install(list(pids.values()))
            return pids

        def _monitor_workers(self, worker_group: Any) -> Any:
            # When a worker has ended with a failure, the agent closes the others at once with
            # SIGTERM (which they would take for a stop request) and SIGKILLs them 30 s later. The
            # others end by themselves within engine.collective_timeout_s, each saying why: they
            # get that long first. A stopped (SIGSTOP) one is continued, so it finds its peer gone.
            handlers = getattr(self._pcontext, "subprocess_handlers", {})
            if not self.grace_given and any(h.proc.poll() not in (None, 0) for h in handlers.values()):
                self.grace_given = True
                running = [h.proc for h in handlers.values() if h.proc.poll() is None]
                for proc in running:
                    _kill(proc.pid, signal.SIGCONT)
                deadline = time.monotonic() + self.grace_s
                while time.monotonic() < deadline and any(proc.poll() is None for proc in running):
                    time.sleep(0.1)
            return super()._monitor_workers(worker_group)

        def exit_codes(self) -> dict[int, int]:
            """Global rank -> exit code of every local worker that ended (the agent's result
            keeps only those that had failed when it looked)."""
            context = self._pcontext
            if context is None or self._worker_group is None:
                return {}
            handlers = getattr(context, "subprocess_handlers", {})
            return {worker.global_rank: handlers[worker.local_rank].proc.returncode
                    for worker in self._worker_group.workers
                    if worker.local_rank in handlers and handlers[worker.local_rank].proc.returncode is not None}

    return Agent


def _Agent(spec: Any, *, logs_specs: Any, forwarder: _SignalForwarder, grace_s: float) -> Any:  # noqa: N802
    """The agent (its class is made lazily: it imports torch)."""
    return _agent_class()(spec, logs_specs, forwarder, grace_s)
