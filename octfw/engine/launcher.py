"""``octfw run RECIPE --nproc-per-node N``: one node's training processes, one job.

Built on torch.distributed.elastic's public interfaces, the pieces torchrun
is made of: the c10d rendezvous (``RendezvousParameters``,
``next_rendezvous``: which node is which, and the store the workers share),
``start_processes`` (the workers, each with torch's error file,
``TORCHELASTIC_ERROR_FILE``) and its process context (``pids``, ``wait``,
``close``). No restarts: a failed process ends the job, and ``--resume auto``
continues it. What octfw decides itself:

- **Exit codes that mean what they say.** Every worker hands the launcher
  its final line and exit code (:func:`report_outcome`), marked as a *cause*
  (a crash, a refusal, a guard's stop, a failed final save, a preemption) or
  a *consequence* (a peer it lost). The job exits with the first cause in
  time, named with its rank: 1 for a crash (the bug's traceback is that
  rank's alone), 2 for a refusal, 74, 75, 130. Only a process that vanished
  with no word (killed by a signal, named) or that stopped answering makes
  the job's 76, the one code besides 75 that a requeue loop retries.
- **One line for the job.** Only rank 0's log reaches the console while
  training; the launcher prints the job's one line. The ranks that only saw
  a peer go stay silent.
- **Time to say why.** When a worker ends with a failure, the others get
  ``engine.collective_timeout_s`` (and :data:`LOST_PEER_REPORT_S`) to notice
  and end by themselves; a stopped (SIGSTOP) one is continued so that it
  finds its peer gone; what is left is killed.
- **No worker outlives the job.** torch starts each worker in a session of its
  own; each worker ends itself when the launcher dies, however it dies
  (:func:`die_with_launcher`), and the launcher closes its workers on every
  path out of :func:`launch_job`.
- **Signals forwarded once.** SIGTERM and SIGINT received by the launcher go
  to every worker as they came, SIGHUP (a closed terminal) and SIGQUIT as
  SIGTERM (Kubernetes stops a pod with a SIGTERM to its first process only);
  a worker counts a repeat that the process group had already delivered once
  (:data:`octfw.engine.preemption.DUPLICATE_WINDOW_S`). They are heard until
  :func:`launch_job` returns (the nodes' agreement included), and the
  caller's handlers are then its own again.
  A second signal stops the job at once: the workers stop where they are and
  whatever still runs after :data:`STOP_NOW_GRACE_S` is killed; exit 130, the
  last complete checkpoint kept.
- **The same answer on every node.** Each node's launcher puts its outcome
  in the rendezvous store and reads the others' before it exits: every node
  of a job exits with the same code and line.
- **The machine shared fairly.** ``OMP_NUM_THREADS`` is the process's share
  of this node's cores unless the user set it (torchrun sets 1).
- **No unbounded wait, no retried typo.** The rendezvous of the nodes waits at
  most ``engine.collective_timeout_s``; the grace above and the nodes' exchange
  of outcomes at most that plus :data:`LOST_PEER_REPORT_S`. An endpoint that is
  malformed, does not resolve, or where no rendezvous answers is a user's
  mistake (exit 2, one line); only nodes that do not all come make a 76.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, NoReturn

import attrs

from octfw.engine.preemption import STOP_SIGNALS
from octfw.display.errors import UserError, one_line
from octfw.cli.exit_codes import FINISHED, INTERRUPTED_EXIT_CODE, PEER_LOST_EXIT_CODE, describe

__all__ = ["launch_job", "processes_per_node", "report_outcome", "job_command", "die_with_launcher",
           "exit_without_teardown", "rendezvous_endpoint", "quiet_torch_cpp_logs", "JOB_STATUS_ENV", "JOB_COMMAND_ENV",
           "LAUNCHER_PID_ENV", "Outcome", "job_outcome"]

log = logging.getLogger(__name__)

#: Set for the workers: the folder where each writes its outcome (:func:`report_outcome`).
JOB_STATUS_ENV = "OCTFW_JOB_STATUS_DIR"
#: Set for the workers: the command that runs the whole job again (``--nproc-per-node`` and the
#: nodes included), for the "resume with" line of every worker.
JOB_COMMAND_ENV = "OCTFW_JOB_COMMAND"

#: Set for the workers: the launcher's pid, which each worker follows (:func:`die_with_launcher`).
LAUNCHER_PID_ENV = "OCTFW_LAUNCHER_PID"

#: Seconds a process needs, beyond the collective timeout, to name a lost peer and end (the liveness
#: census, the newest checkpoint read back, the interpreter's exit).
LOST_PEER_REPORT_S = 20.0
#: After a second stop signal, seconds the workers get to stop where they are before they are killed.
STOP_NOW_GRACE_S = 5.0
#: Seconds the nodes wait for one another to have read the job's outcome (the store's host leaves last).
READ_WAIT_S = 10.0
#: The longest one call to the job's store may take while the nodes agree (a stop signal waits for it).
STORE_CALL_S = 5.0
#: How often the launcher looks at its workers.
POLL_S = 0.1


# --- what a worker reports -------------------------------------------------------------------


@attrs.frozen
class Outcome:
    """How one process (or one node) ended: its exit code, its one line, whether it is a cause
    of the job's end or a consequence of another's (a lost peer), the newest complete checkpoint
    it knows, when it was reported and by which rank."""

    code: int
    line: str
    cause: bool = True
    checkpoint: str | None = None
    at: float = 0.0
    rank: int | None = None

    @classmethod
    def from_json(cls, text: str) -> "Outcome":
        return cls(**json.loads(text))

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))


def report_outcome(outcome: Outcome) -> None:
    """This worker's final line: written for the launcher under ``--nproc-per-node`` (which
    prints one line for the job), else printed."""
    status_dir = os.environ.get(JOB_STATUS_ENV)
    if not status_dir:
        if outcome.line:
            print(outcome.line, file=sys.stderr)
        return
    rank = int(os.environ.get("RANK", "0"))
    path = Path(status_dir) / f"rank{rank:05d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(attrs.evolve(outcome, line=one_line(outcome.line), at=time.time(), rank=rank).to_json(),
                   encoding="utf-8")
    tmp.replace(path)


def die_with_launcher() -> None:
    """In a worker this launcher started: end when the launcher ends, however it ends.

    torch starts each worker in a session of its own, so a signal to the launcher's process
    group never reaches it, and a launcher killed with SIGKILL (an out-of-memory kill, a
    ``kill -9``) would leave it training with parent pid 1, holding the run folder and its
    devices. Linux sends SIGKILL to this process when its parent dies (``PR_SET_PDEATHSIG``):
    SIGKILL, not SIGTERM, because nobody is left to hear how the job ended and the newest
    complete checkpoint is what ``--resume auto`` continues. Elsewhere a thread watches the
    parent pid. A launcher that died before this call is found by its pid."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return
    if not sys.platform.startswith("linux") or not _parent_death_signal(signal.SIGKILL):
        import threading

        def watch() -> None:
            while os.getppid() == int(launcher):
                time.sleep(POLL_S)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="octfw-launcher-watch", daemon=True).start()
    if os.getppid() != int(launcher):  # it ended before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)``; whether it took."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(signum), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG (linux/prctl.h)
    except (OSError, AttributeError):
        return False


def exit_without_teardown(code: int) -> NoReturn:
    """End a process of a job (a worker, or the launcher) with ``code`` once the job's outcome is
    said: Python's exit handlers run (a logger's service, logging's flush), the interpreter's
    teardown does not. In that teardown torch's C++ objects (a store's server thread, gloo's
    threads) are destroyed in no set order, and under load one ended the process in
    ``std::terminate`` ("terminate called without an active exception", SIGABRT) after a job
    had finished: noise on the console, and an exit code its outcome did not choose."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def job_command(fallback: str) -> str:
    """The command that runs this job again: the launcher's, where a launcher started this process."""
    return os.environ.get(JOB_COMMAND_ENV) or fallback


# --- the job's outcome -----------------------------------------------------------------------


def job_outcome(reports: dict[int, Outcome], exit_codes: dict[int, int], messages: dict[int, str],
                command: str, ended_at: dict[int, float] | None = None, ended_by_launcher: frozenset = frozenset(),
                unresponsive: frozenset = frozenset()) -> Outcome:
    """The job's outcome from every process's report (rank -> :class:`Outcome`), exit code, torch
    error-file message (a crash before octfw could report it), when each ended, which ranks
    the launcher itself ended (after the grace, or a second signal), and which had stopped
    answering (their liveness marks still) when the first process failed:

    1. a process that failed with no report: killed by a signal (named), or an exit code that
       octfw did not choose; a cause, dated when it ended (one the launcher ended is not a cause).
       A process that aborted (SIGABRT) while others had stopped answering names those: it
       waited for them (NCCL's watchdog ends a rank whose collective timed out so);
    2. the first *cause* in time decides: a silent death is named itself; otherwise its code
       (a crash, a refusal, a stop, a failed save) is the job's, and the lowest rank that said
       that code says the line (a shared decision: rank 0's, which knows the checkpoint);
    3. else the consequences (a peer that stopped answering: 76), the lowest rank's;
    4. else every process finished (0, or the lowest rank's line).
    """
    said, reports = reports, dict(reports)
    newest = max((r.checkpoint for r in reports.values() if r.checkpoint), default=None)  # step_N: sortable
    for rank, code in exit_codes.items():
        if code != 0 and rank not in reports:
            # Only an abort (SIGABRT: NCCL's watchdog, a C++ check) may be a rank that waited; a kill
            # (SIGKILL: out of memory, kill -9) is the kill's own cause.
            waited = code == -signal.SIGABRT
            silent = _silent_failure(rank, code, messages.get(rank, ""), newest, command,
                                     sorted(unresponsive - {rank}) if waited else [])
            reports[rank] = attrs.evolve(silent, at=(ended_at or {}).get(rank, silent.at),
                                         cause=rank not in ended_by_launcher)
    causes = sorted((r for r in reports.values() if r.cause and r.code != FINISHED), key=lambda r: r.at)
    if causes:
        first = causes[0]
        if first.rank not in said:  # a silent death: the first to end is the one named
            return first
        return min((r for r in causes if r.code == first.code and r.rank in said), key=lambda r: r.rank or 0)
    failed = [r for r in reports.values() if r.code != FINISHED]
    if failed:
        return min(failed, key=lambda r: r.rank or 0)
    return reports[min(reports)] if reports else Outcome(FINISHED, "")


def _silent_failure(rank: int, code: int, message: str, newest: str | None, command: str,
                    unresponsive: list[int]) -> Outcome:
    """A process that ended without a word from octfw: the job lost it (76). ``newest``: the
    newest complete checkpoint the others know; ``unresponsive``: the ranks that had stopped
    answering when it ended, named first."""
    if code < 0:
        what = f"was {describe(code)}"  # "was killed by SIGKILL": an out-of-memory kill, a kill -9
    else:
        what = f"ended with exit code {code}" + (f" ({one_line(message)})" if message else "")
    who = f"the process of rank {rank} {what}"
    if unresponsive:
        silent = ", ".join(map(str, unresponsive))
        who = (f"the {'process' if len(unresponsive) == 1 else 'processes'} of rank {silent} stopped answering "
               f"(rank {rank}, waiting for it, {what})")
    return Outcome(PEER_LOST_EXIT_CODE,
                   f"octfw: error: {who}; the job stopped, and nothing after the newest "
                   f"checkpoint ({newest or 'none yet'}) is saved. Run again: {command}", checkpoint=newest, at=time.time(),
                   rank=rank)


def _read_reports(status_dir: Path) -> dict[int, Outcome]:
    reports = {}
    for path in status_dir.glob("rank*.json"):
        try:
            report = Outcome.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            continue  # cut short by a kill: that process said nothing
        reports[report.rank if report.rank is not None else int(path.stem.removeprefix("rank"))] = report
    return reports


# --- starting and watching the workers -------------------------------------------------------


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


def threads_per_process(nproc: int, environ: dict[str, str]) -> str:
    """``OMP_NUM_THREADS`` for each of ``nproc`` processes on this node: the user's, else an even
    share of the cores this launcher may use (at least 1)."""
    if environ.get("OMP_NUM_THREADS"):
        return environ["OMP_NUM_THREADS"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return str(max(cores // nproc, 1))


def launch_job(worker_argv: list[str], recipe: Any, *, nproc_per_node: str, nnodes: int = 1,
               rdzv_endpoint: str | None = None, rdzv_id: str | None = None, command: str = "") -> int:
    """Run ``octfw <worker_argv>`` in ``nproc_per_node`` processes of a job of ``nnodes`` nodes
    and wait for them; the job's exit code (see the module docstring). ``command``: the
    command line that runs the job again, for the lines that say so. The caller's handlers of
    the stop signals are its own again when this returns, however it returns."""
    from octfw.engine.backend import resolve_device

    nproc = processes_per_node(nproc_per_node, resolve_device(recipe.run.device))
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, the same on every node "
                        "(the first node's address and a free port)")
    endpoint = rendezvous_endpoint(rdzv_endpoint) if rdzv_endpoint else None
    _quiet_torch_logs()
    timeout_s = recipe.engine.collective_timeout_s
    run_id = rdzv_id or (recipe.name if nnodes > 1 else str(uuid.uuid4()))
    callers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    watch = _Watch(grace_s=timeout_s + LOST_PEER_REPORT_S)
    status_dir = Path(tempfile.mkdtemp(prefix="octfw-job-"))
    meeting = None
    try:
        meeting = _Rendezvous(endpoint, rdzv_endpoint, run_id, nnodes, timeout_s)
        rendezvous = meeting.meet()
        if isinstance(rendezvous, Outcome):  # the nodes did not all come
            outcome = rendezvous
        else:
            node = _Node(rendezvous, nproc, run_id, meeting.handler.use_agent_store)
            log.info("job: %s on this node%s", _processes(nproc),
                     f", {node.nodes} nodes meeting at {rdzv_endpoint}" if node.nodes > 1 else "")
            local = _run_workers(node, worker_argv, status_dir, command, watch)
            # A node waits for the others as long as their workers may take to end (the grace included);
            # a stop signal meanwhile ends the wait with what is known.
            # A signal is handled between two calls to the store, never inside one: no call may block
            # longer than a stop should wait (the store's node may be frozen, or gone). The timeout is
            # the store's own: the rendezvous's prefixed view of it forwards every call.
            meeting.store.set_timeout(datetime.timedelta(seconds=STORE_CALL_S))
            # Only a signal after the workers ended stops the agreement (one that ended them, a stop
            # to the whole job, is what the nodes agree on).
            outcome = node.agree(local, timeout_s + LOST_PEER_REPORT_S, command,
                                 stopped=lambda: watch.signals > watch.signals_while_running)
    finally:
        if meeting is not None:
            meeting.close()
        shutil.rmtree(status_dir, ignore_errors=True)
        for sig, handler in callers.items():
            signal.signal(sig, handler)
    if outcome.line:
        print(outcome.line, file=sys.stderr)
    return outcome.code


def rendezvous_endpoint(text: str) -> tuple[str, int]:
    """``--rdzv-endpoint HOST:PORT`` read and its host looked up, or one line naming what is wrong
    (exit 2): a typo never becomes a wait, a traceback or a retry."""
    host, sep, port_text = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:29400
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UserError(f"--rdzv-endpoint {text!r}: expected HOST:PORT with a port from 1 to 65535, "
                        "e.g. node0.cluster:29400")
    try:
        socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UserError(f"--rdzv-endpoint {text}: the host {host!r} does not resolve ({exc}); give the first "
                        "node's address, the same on every node") from None
    return host, int(port_text)


class _Rendezvous:
    """Where the job's nodes meet (torch's c10d rendezvous and the store it shares), every wait
    bounded by ``engine.collective_timeout_s``; a node count this node can report when they do not."""

    def __init__(self, endpoint: tuple[str, int] | None, written: str | None, run_id: str, nnodes: int,
                 timeout_s: float):
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        self.written, self.nnodes, self.timeout_s = written or "this node", nnodes, timeout_s
        self.key = f"octfw/joining/{run_id}"
        seconds = str(max(int(math.ceil(timeout_s)), 1))
        params = RendezvousParameters(
            backend="c10d", endpoint=f"{endpoint[0]}:{endpoint[1]}" if endpoint else "localhost:0", run_id=run_id,
            min_nodes=nnodes, max_nodes=nnodes, join_timeout=seconds, read_timeout=seconds,
            close_timeout=str(int(STORE_CALL_S)))  # a node that closes waits no longer than a stop should
        try:
            backend, self.store = create_backend(params)
        except Exception as exc:  # noqa: BLE001 - torch's RendezvousConnectionError: nothing answered there
            raise UserError(f"--rdzv-endpoint {self.written}: no rendezvous answered there within "
                            f"engine.collective_timeout_s = {timeout_s:g} s ({_cause(exc)}); give the first node's "
                            "address and a free port on it, the same on every node") from None
        self.handler = create_handler(self.store, backend, params)
        self.store.add(self.key, 1)  # this node came: a timeout says how many did

    def meet(self) -> Any:
        """The rendezvous (which node this is, the store), or the job's outcome when not every node
        came within the timeout: 76, which a requeue loop retries a bounded number of times."""
        try:
            return self.handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - the nodes did not all come: one line
            log.debug("the job's rendezvous failed", exc_info=exc)
            came = self._came()
            with contextlib.suppress(Exception):
                self.store.add(self.key, -1)  # this node leaves: the others' count stays true
            counted_nodes = f"{came} of {self.nnodes} nodes" if came is not None else f"not all {self.nnodes} nodes"
            return Outcome(PEER_LOST_EXIT_CODE,
                           f"octfw: error: the job's processes could not start: {counted_nodes} met at "
                           f"{self.written} within engine.collective_timeout_s = {self.timeout_s:g} s "
                           f"({_cause(exc)}); start every node with the same --nnodes, --rdzv-endpoint and "
                           "--rdzv-id")

    def _came(self) -> int | None:
        try:
            return int(self.store.add(self.key, 0))
        except Exception:  # noqa: BLE001 - the node that hosted the store has gone already
            return None

    def close(self) -> None:
        # Close the rendezvous as torchrun does: its store thread left running at exit would end the
        # launcher in std::terminate ("terminate called without an active exception", SIGABRT).
        # Every call to a store that does not answer (its node frozen) waits at most STORE_CALL_S.
        with contextlib.suppress(Exception):
            self.store.set_timeout(datetime.timedelta(seconds=STORE_CALL_S))
        try:
            self.handler.shutdown()
        except Exception as exc:  # noqa: BLE001 - the job's outcome is known; this is tidying up
            log.debug("closing the rendezvous failed", exc_info=exc)


def _cause(exc: BaseException) -> str:
    """The first line of what went wrong: the error torch wrapped ("see inner exception"), if any."""
    reason = exc.__cause__ or exc
    return one_line(f"{type(reason).__name__}: {(str(reason).strip().splitlines() or [''])[0]}".rstrip(": "))


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def quiet_torch_cpp_logs() -> None:
    """For a launcher, before anything imports torch: torch's C++ store prints a warning with a
    stack trace for every retry of a connection to a rendezvous that does not answer ("TCP
    client failed to connect/validate ... retrying"), where the launcher's one line says what
    failed. torch reads its C++ log level once, when it is imported, so the CLI calls this
    before it loads the plugins (which may import torch). FATAL for the launcher only, unless
    the user chose a level; the workers' environment leaves it out, they log as usual."""
    global _QUIETED_CPP_LOGS
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    _QUIETED_CPP_LOGS = True


#: Whether :func:`quiet_torch_cpp_logs` set this process's C++ log level (the workers' is theirs).
_QUIETED_CPP_LOGS = False


def _quiet_torch_logs() -> None:
    """torch's elastic lines (rendezvous rounds, "Sending process ... closing signal") are not
    the user's business: the job's one line says how it ended."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


class _Node:
    """This node among the job's nodes, from the rendezvous: its workers' global ranks, the store
    they share (the launcher's: it outlives any worker), and the exchange of outcomes."""

    def __init__(self, rendezvous: Any, nproc: int, run_id: str, use_agent_store: bool):
        self.store, self.index, self.nodes = rendezvous.store, rendezvous.rank, rendezvous.world_size
        self.nproc, self.run_id, self.use_agent_store = nproc, run_id, use_agent_store
        self.master = rendezvous.bootstrap_store_info
        self._check_same_size()

    def _check_same_size(self) -> None:
        """Every node runs the same command: the same number of processes (global ranks are
        ``node x nproc + local``)."""
        self.store.set(f"octfw/nproc/{self.index}", str(self.nproc))
        sizes = {i: int(self.store.get(f"octfw/nproc/{i}")) for i in range(self.nodes)}
        if len(set(sizes.values())) > 1:
            raise UserError(f"--nproc-per-node differs between the nodes of the job ({sizes}); every node runs "
                            "the same command")

    def environment(self, local_rank: int, threads: str) -> dict[str, str]:
        """A worker's environment, as torchrun documents it for its workers."""
        world = self.nodes * self.nproc
        rank = self.index * self.nproc + local_rank
        inherited = {k: v for k, v in os.environ.items() if not (_QUIETED_CPP_LOGS and k == "TORCH_CPP_LOG_LEVEL")}
        return {**inherited,
                "LOCAL_RANK": str(local_rank), "RANK": str(rank), "GROUP_RANK": str(self.index),
                "ROLE_RANK": str(rank), "ROLE_NAME": "octfw", "LOCAL_WORLD_SIZE": str(self.nproc),
                "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(self.nodes), "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": self.master.master_addr, "MASTER_PORT": str(self.master.master_port),
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": self.run_id, "TORCHELASTIC_USE_AGENT_STORE": str(self.use_agent_store),
                "OMP_NUM_THREADS": threads}

    def silent(self, ranks: list[int]) -> list[int]:
        """Which of ``ranks`` stopped marking themselves alive in the job's store (the workers mark
        it every second: :func:`octfw.engine.distributed.silent_ranks`); none where it cannot tell."""
        import torch.distributed as dist

        from octfw.engine.distributed import silent_ranks

        if not ranks:
            return []
        try:
            store = dist.TCPStore(self.master.master_addr, self.master.master_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=STORE_CALL_S))
        except Exception as exc:  # noqa: BLE001 - the store's node is gone: no names
            log.debug("the job's store did not answer for the liveness marks", exc_info=exc)
            return []
        return silent_ranks(store, ranks, marked_only=True) or []

    def agree(self, local: Outcome, wait_s: float, command: str, stopped: Callable[[], bool]) -> Outcome:
        """The job's outcome, the same on every node: each node's own goes to the store, and
        :func:`job_outcome` decides over them (a node that never reports within ``wait_s`` was lost).
        A stop signal (``stopped()``) ends the wait: the agreed outcome if every node has reported,
        else 130 with this node's own line."""
        if self.nodes == 1:
            return local
        interrupted = Outcome(INTERRUPTED_EXIT_CODE, f"octfw: stopped while the nodes agreed on how the job ended; "
                              f"this node's processes ended with {local.code}"
                              + (f": {local.line.removeprefix('octfw: ')}" if local.line else ""),
                              checkpoint=local.checkpoint, at=time.time(), rank=self.index)
        try:
            self.store.set(f"octfw/outcome/{self.index}", attrs.evolve(local, rank=self.index).to_json())
            _count_up(self.store, "octfw/reported", self.nodes, wait_s, stopped)
            outcomes = {i: Outcome.from_json(self.store.get(f"octfw/outcome/{i}").decode())
                        for i in range(self.nodes) if self.store.check([f"octfw/outcome/{i}"])}
        except Exception as exc:  # noqa: BLE001 - the store's node is gone or frozen: this node's own view
            log.debug("the nodes' outcomes could not be exchanged", exc_info=exc)
            return interrupted if stopped() else local
        if stopped() and len(outcomes) < self.nodes:
            return interrupted
        for missing in (i for i in range(self.nodes) if i not in outcomes):
            outcomes[missing] = Outcome(
                PEER_LOST_EXIT_CODE, f"octfw: error: node {missing} of the job never said how it ended (waited "
                f"{wait_s:g} s); nothing after the newest checkpoint is saved. Run again: {command}",
                at=time.time(), rank=missing)
        try:  # the node that hosts the store (whichever bound the endpoint) keeps it up until all have read
            _count_up(self.store, "octfw/read", self.nodes, READ_WAIT_S, stopped)
        except Exception as exc:  # noqa: BLE001 - read already: the decision stands
            log.debug("the store closed after this node read the outcomes", exc_info=exc)
        return job_outcome(outcomes, {}, {}, command)


def _count_up(store: Any, key: str, target: int, timeout_s: float, stopped: Callable[[], bool]) -> bool:
    """Add this node to the counter ``key``, then wait (at most ``timeout_s``, and not once
    ``stopped()``) for it to reach ``target``; whether it did."""
    deadline = time.monotonic() + timeout_s
    count = store.add(key, 1)
    while count < target and time.monotonic() < deadline and not stopped():
        time.sleep(POLL_S)
        count = store.add(key, 0)
    return count >= target


def _run_workers(node: _Node, worker_argv: list[str], status_dir: Path, command: str, watch: "_Watch") -> Outcome:
    """Start this node's workers, watch them until every one has ended, and say how this
    node's part of the job ended. No worker outlives this call: whatever ends it (a bug, a
    third Ctrl-C), the workers still running are closed; and each worker ends itself when the
    launcher dies (:func:`die_with_launcher`: a SIGKILL, an out-of-memory kill)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    threads = threads_per_process(node.nproc, dict(os.environ))
    envs = {local: {**node.environment(local, threads), JOB_STATUS_ENV: str(status_dir), JOB_COMMAND_ENV: command,
                    LAUNCHER_PID_ENV: str(os.getpid())}
            for local in range(node.nproc)}
    context = start_processes(
        name="octfw", entrypoint=sys.executable,
        args={local: ("-m", "octfw.cli", *worker_argv) for local in range(node.nproc)}, envs=envs,
        logs_specs=DefaultLogsSpecs(log_dir=str(status_dir / "torch")))
    try:
        pids = context.pids()
        ranks = {local: node.index * node.nproc + local for local in pids}
        watch.start(pids, lambda running: [local for local in running if ranks[local] in
                                           node.silent([ranks[local] for local in running])])
        watch.until_all_ended()
        result = context.wait(0)  # every worker has ended: their exit codes and error files
    finally:
        context.close(timeout=int(STOP_NOW_GRACE_S))  # on every path out: none left running
    failures = result.failures if result is not None else {}
    exit_codes = {ranks[local]: code for local, code in watch.exit_codes.items()}
    messages = {ranks[local]: failure.message for local, failure in failures.items()
                if os.path.isfile(failure.error_file)}  # a crash before octfw could report it (torch's error file)
    outcome = job_outcome(_read_reports(status_dir), exit_codes, messages, command,
                          ended_at={ranks[local]: at for local, at in watch.ended_at.items()},
                          ended_by_launcher=frozenset(ranks[local] for local in watch.killed),
                          unresponsive=frozenset(ranks[local] for local in watch.unresponsive))
    if watch.signals >= 2:  # stopped at once: whatever the workers managed to say
        return Outcome(INTERRUPTED_EXIT_CODE, outcome.line if outcome.code == INTERRUPTED_EXIT_CODE else
                       f"octfw: stopped at once by a second signal; the last complete checkpoint is kept. "
                       f"Resume with: {command}")
    return outcome


class _Watch:
    """The workers, watched without reaping them (``waitid`` with ``WNOWAIT``: torch's process
    context reads their exit codes after), and the launcher's handler of the stop signals from
    the workers' start to the end of :func:`launch_job` (the nodes' agreement included)."""

    def __init__(self, grace_s: float):
        self.pids: dict[int, int] = {}
        self.grace_s = grace_s
        self.exit_codes: dict[int, int] = {}
        self.ended_at: dict[int, float] = {}  #: local rank -> when the launcher saw it end (time.time())
        self.killed: set[int] = set()  #: local ranks the launcher itself killed
        self.unresponsive: set[int] = set()  #: local ranks that had stopped answering at the first failure
        self.signals = 0
        self.signals_while_running = 0  #: how many stop signals came while a worker was still running
        self._kill_at: float | None = None
        self._silent: Callable[[list[int]], list[int]] = lambda running: []

    def start(self, pids: dict[int, int], silent: Callable[[list[int]], list[int]]) -> None:
        """Watch ``pids`` (local rank -> pid) and handle the stop signals (over torch's, which raise).
        ``silent``: which of the given local ranks stopped answering (asked at the first failure)."""
        self.pids, self._silent = dict(pids), silent
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _running(self) -> dict[int, int]:
        return {local: pid for local, pid in self.pids.items() if local not in self.exit_codes}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        # Asked now, not from the watch's last look (it may lag under load): a signal once every
        # worker has ended is for the nodes' agreement, not a stop of the job.
        running = {local: pid for local, pid in self._running().items() if _ended(pid) is None}
        if running:
            self.signals_while_running += 1
        if self.signals >= 2:  # stop now: the workers stop where they are, what is left is killed
            deadline = time.monotonic() + (STOP_NOW_GRACE_S if self.signals == 2 else 0.0)
            self._kill_at = min(self._kill_at or deadline, deadline)
        # A closed terminal (SIGHUP) or Ctrl-\ (SIGQUIT): a stop request, as SIGTERM is.
        forwarded = signum if signum in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM
        for pid in running.values():
            _kill(pid, forwarded)

    def until_all_ended(self) -> None:
        while len(self.exit_codes) < len(self.pids):
            for local, pid in self.pids.items():
                if local not in self.exit_codes:
                    code = _ended(pid)
                    if code is not None:
                        self.exit_codes[local], self.ended_at[local] = code, time.time()
            if self._kill_at is None and any(code != 0 for code in self.exit_codes.values()):
                # A worker failed: the others get the time to notice and say why; a stopped one
                # is continued, so that it finds its peer gone; but first, which had stopped
                # answering (the one that failed may only have waited for them).
                if self.signals == 0:
                    self.unresponsive = set(self._silent(list(self._running())))
                self._kill_at = time.monotonic() + self.grace_s
                for pid in self._running().values():
                    _kill(pid, signal.SIGCONT)
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                for local, pid in self._running().items():
                    self.killed.add(local)
                    _kill(pid, signal.SIGKILL)
            time.sleep(POLL_S)


def _ended(pid: int) -> int | None:
    """The exit code of the child ``pid`` once it has ended (negative: the signal that killed it),
    else None; the child stays waitable for its owner."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
