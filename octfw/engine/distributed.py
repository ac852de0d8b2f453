"""Scale-out on existing engines, and the decisions every process of a job shares.

- GPUs and CPUs: torch.distributed data parallel (DDP), one process per
  device, started by ``octfw run --nproc-per-node`` (:mod:`octfw.engine.launcher`),
  torchrun or Slurm's srun; gloo on the CPU, NCCL on CUDA.
- TPUs: XLA SPMD in one process per host, driving all of that host's
  devices; multi-host through PJRT (every host runs the same ``octfw run``).
  Each host loads only its own part of every global batch
  (:class:`BatchLayout`); docs/tpu-pods.md says how to launch and resume.

:func:`join` works out once who this process is (:class:`Processes`: rank,
world, local rank, device) and selects the device *before* the process
group exists (NCCL collectives run on the current device). It returns the
job's :class:`Peers`: a gloo group of its own, on the CPU, through which
every decision that stops, skips or resumes the run is agreed before any
process acts on it, so the GPU stream is never waited on for it. Every wait
on a peer is bounded by ``engine.collective_timeout_s``; a peer that dies or
stops answering ends the wait with :class:`PeerLost`, which names it.

Only rank 0 logs, writes files and talks to W&B.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import threading
import time
from typing import Any, Mapping, Sequence

import attrs
import torch

from octfw.display.errors import UserError
from octfw.display.tables import counted

__all__ = ["BatchLayout", "Processes", "Peers", "PeerLost", "join", "nccl_environment", "xla_processes", "xla_spmd",
           "all_reduce_", "min_across_ranks", "layout_for", "step_time", "silent_ranks"]

logger = logging.getLogger(__name__)


@attrs.frozen
class BatchLayout:
    """How one update step's global batch splits over processes, devices and micro-steps.

    A *process* loads data: one per TPU host under SPMD (driving all of that
    host's devices), one per device under torchrun. Every process loads the
    same number of samples per micro-step, so the global batch is
    ``per_device_batch x devices x grad_accum_steps`` whatever the split.
    """

    per_device_batch: int
    grad_accum_steps: int
    processes: int = 1
    devices_per_process: int = 1

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process

    @property
    def process_micro_batch(self) -> int:
        """Samples one process loads per micro-step (its data loader's batch size)."""
        return self.per_device_batch * self.devices_per_process

    @property
    def global_micro_batch(self) -> int:
        """Samples of one micro-step over all devices: one forward/backward."""
        return self.process_micro_batch * self.processes

    @property
    def global_batch(self) -> int:
        """Samples of one update step over all devices and micro-steps."""
        return self.global_micro_batch * self.grad_accum_steps

    @property
    def process_batch(self) -> int:
        """Samples one process loads per update step (its share of the global batch)."""
        return self.process_micro_batch * self.grad_accum_steps

    def describe(self) -> str:
        """One line, e.g. for a TPU v4-32: ``global batch 32 = per_device_batch 1 x 16
        devices x grad_accum_steps 2; 4 processes x 4 devices: each process loads 4
        samples per micro-step, 8 per update step``."""
        split = ("1 process loads" if self.processes == 1 else
                 f"{self.processes} processes x {counted(self.devices_per_process, 'device')}: "
                 "each process loads")
        return (f"global batch {self.global_batch} = per_device_batch {self.per_device_batch} x "
                f"{counted(self.devices, 'device')} x grad_accum_steps {self.grad_accum_steps}; {split} "
                f"{counted(self.process_micro_batch, 'sample')} per micro-step, "
                f"{self.process_batch} per update step")


def step_time(layout: BatchLayout, global_batch: int | None, micro_step_s: float) -> str:
    """One line: the global batch that will run on this layout, and what one update step takes
    (``micro_step_s`` measured on one micro-step). ``octfw check`` and ``octfw run`` say it."""
    batch = (f"engine.global_batch = {global_batch} kept on {counted(layout.devices, 'device')}"
             if global_batch is not None else f"global batch {layout.global_batch} on {counted(layout.devices, 'device')}")
    return (f"{batch}: {counted(layout.grad_accum_steps, 'micro-step')} of per_device_batch {layout.per_device_batch} "
            f"per update step; one update step about {_duration(micro_step_s * layout.grad_accum_steps)} "
            f"(one micro-step: {_duration(micro_step_s)})")


def _duration(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 120 else f"{seconds / 60:.3g} min" if seconds < 7200 \
        else f"{seconds / 3600:.3g} h"


def layout_for(per_device_batch: int, grad_accum_steps: int, global_batch: int | None, *,
               processes: int = 1, devices_per_process: int = 1, kept: int | None = None) -> BatchLayout:
    """The run's :class:`BatchLayout` on the devices found. With ``engine.global_batch`` pinned,
    ``grad_accum_steps`` is derived from the device count (the seeds' formula, ``global_batch /
    (per_device_batch x devices)``), and refused in one line when it does not divide. Unpinned,
    ``kept`` (the global batch a resumed run trains at, recorded at its first start) is kept
    the same way: the schedule and the data order count in it, whatever the devices now."""
    what = "engine.global_batch"
    if global_batch is None and kept is not None:
        global_batch, what = kept, "the global batch the run trains at (RUN/run.json)"
    if global_batch is not None:
        devices = processes * devices_per_process
        per_micro_step = per_device_batch * devices
        if global_batch % per_micro_step:
            way_out = (f"choose a multiple of {per_micro_step}" if what == "engine.global_batch" else
                       "run it on a device count that divides it, or with an engine.per_device_batch that does")
            raise UserError(f"{what} = {global_batch} does not divide over {counted(devices, 'device')} x "
                            f"engine.per_device_batch {per_device_batch} = {per_micro_step} samples per "
                            f"micro-step; {way_out}")
        grad_accum_steps = global_batch // per_micro_step
    return BatchLayout(per_device_batch, grad_accum_steps, processes=processes,
                       devices_per_process=devices_per_process)


@attrs.frozen
class Processes:
    """Who this process is among the job's processes, worked out once by :func:`join`.

    ``rank`` and ``world_size`` count data-parallel processes: one per device
    under DDP, one per host under XLA SPMD (whose devices are counted by the
    backend). ``device`` is the torch device this process trains on.
    """

    kind: str  #: "cpu", "cuda" or "xla"
    device: torch.device | None = None  #: None on xla until torch_xla is imported (the backend's job)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class PeerLost(RuntimeError):
    """A process of the job died or stopped answering; the message names it where it can."""


def _environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables, else from srun's.

    srun starts one task per process and sets ``SLURM_PROCID``, ``SLURM_NTASKS`` and
    ``SLURM_LOCALID``; the rendezvous address comes from ``MASTER_ADDR``/``MASTER_PORT``,
    which the batch script exports (docs/distributed.md)."""
    env = os.environ
    if "WORLD_SIZE" in env:
        return int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0"))
    return 0, 1, 0


def join(kind: str, timeout_s: float) -> tuple[Processes, "Peers"]:
    """Who this process is, with its device selected, and the job's peers (one process: alone).

    On CUDA the device is ``cuda:LOCAL_RANK``, made current *before* the process group
    exists and passed as its ``device_id``, so NCCL never starts every rank on ``cuda:0``.
    ``timeout_s`` bounds every collective and the process group's own rendezvous."""
    if kind == "xla":
        return _join_xla(timeout_s)
    rank, world, local_rank = _environment()
    device = torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError("run.device = \"cuda\" but torch sees no CUDA device; use \"cpu\" or \"auto\"")
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {local_rank} but this node has {counted(torch.cuda.device_count(), 'GPU')}; "
                            "start at most one process per GPU (--nproc-per-node auto)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before any collective: NCCL uses the current device
    processes = Processes(kind, device, rank, world, local_rank)
    if world <= 1:
        return processes, Peers(processes)
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("RANK", str(rank))  # srun's tasks: env:// reads these
        os.environ.setdefault("WORLD_SIZE", str(world))
        if kind == "cuda":
            # torch's NCCL group reads its watchdog's settings once, when it is created.
            nccl = nccl_environment(timeout_s, os.environ)
            os.environ.update(nccl)
            logger.debug("NCCL settings from engine.collective_timeout_s = %g s: %s", timeout_s,
                         ", ".join(f"{k}={v}" for k, v in nccl.items()) or "all set by the user")
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return processes, Peers(processes, dist.new_group(backend="gloo", timeout=timeout), timeout_s,
                            owns_process_group=created)


#: torch's NCCL settings that :func:`nccl_environment` gives a CUDA job, each with the older names
#: torch 2.9 still reads for it (a value the user set under any of them is kept).
NCCL_SETTINGS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": (),
    "TORCH_NCCL_ENABLE_MONITORING": (),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": (),
}


def nccl_environment(timeout_s: float, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before a CUDA job's NCCL group is created, so that its watchdog
    ends a lost or stuck collective within ``engine.collective_timeout_s`` (``timeout_s``)
    and a small margin; the variables the user set (``environ``) are left out, theirs hold.

    As torch 2.9's ``ProcessGroupNCCL`` reads them (docs/distributed.md says more):

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` ("TearDown"): a collective that fails or runs past
      the group's ``timeout`` makes the watchdog abort the NCCL communicators (the kernels stop,
      so nothing waits on them any more) and end the process. torch's default, 3, ends it without
      the abort; 2 would abort and let the step go on with what the collective left.
    - ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``: before acting, the watchdog waits 4 times this
      for the flight recorder's dump (torch: 15 s, so 60 s); here a tenth of the timeout, at
      most 15 s, so the abort comes by 1.4 x the timeout.
    - ``TORCH_NCCL_ENABLE_MONITORING=1`` (torch's default, stated) and
      ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` = the timeout (torch: 480 s): the heartbeat monitor
      looks at the watchdog every this many seconds; a watchdog that hangs itself, in a CUDA or
      NCCL call the collective timeout cannot interrupt, is found at the next look and the
      process ended one more such wait later (within about 3 x the timeout).
    """
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(max(100, min(15_000, math.ceil(timeout_s * 100)))),
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(1, math.ceil(timeout_s))),
    }
    return {name: value for name, value in wanted.items()
            if not any(n in environ for n in (name, *NCCL_SETTINGS[name]))}


def xla_processes() -> Processes:
    """This host among the hosts of an XLA runtime (a TPU pod slice: one process per host)."""
    import torch_xla.runtime as xr

    return Processes("xla", None, xr.process_index(), xr.process_count(), 0)


def xla_spmd() -> bool:
    """Whether this XLA runtime trains under SPMD, which this call switches on if so: whenever it
    has more than one device (every host of a pod slice, one host with several chips, the CPU
    device with ``CPU_NUM_DEVICES`` > 1), one process per host drives all of that host's devices.

    Called before anything depends on it (:func:`join` for the hosts' group, then the backend):
    torch_xla requires it before any XLA tensor exists, and its ``xla://`` rendezvous gives a
    group the host's ``process_index`` and ``process_count`` only under SPMD (outside it, the
    device ordinal and the device count). Calling it again changes nothing."""
    import torch_xla.runtime as xr

    if xr.global_runtime_device_count() <= 1:
        return False
    if not xr.is_spmd():
        xr.use_spmd()
    return True


def _join_xla(timeout_s: float) -> tuple[Processes, "Peers"]:
    """XLA: one process per host. With several hosts, the host-side decisions travel over a gloo
    group that torch_xla's coordinator sets up (``xla://``), beside SPMD's device collectives.

    In the order torch_xla 2.9 documents for SPMD ("SPMD User Guide", Process Groups):
    ``use_spmd()`` first, then ``init_process_group("gloo", init_method="xla://")``, so that the
    group's rank and size are this host's process index and the process count; checked."""
    xla_spmd()  # first: before the group below, and before any XLA tensor
    processes = xla_processes()
    if processes.world_size <= 1:
        return processes, Peers(processes)
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the xla:// init method

    timeout = datetime.timedelta(seconds=timeout_s)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method="xla://", timeout=timeout)
    if (dist.get_rank(), dist.get_world_size()) != (processes.rank, processes.world_size):
        raise UserError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, but torch_xla "
                        f"reports host {processes.rank} of {processes.world_size}: was torch.distributed "
                        "initialised before octfw, or without SPMD? (docs/tpu-pods.md)")
    return processes, Peers(processes, dist.new_group(backend="gloo", timeout=timeout), timeout_s,
                            owns_process_group=created)


def all_reduce_(*tensors: torch.Tensor) -> None:
    """Sum in place across the job's processes (the caller knows there are several:
    ``Backend.across_processes``)."""
    import torch.distributed as dist

    for t in tensors:
        dist.all_reduce(t)


def min_across_ranks(verdict: torch.Tensor) -> torch.Tensor:
    """A boolean verdict that is True only if it is True on every DDP process."""
    import torch.distributed as dist

    value = verdict.float()
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return value > 0


#: What the messages of collectives that lost a peer contain (gloo and NCCL raise RuntimeError).
_COLLECTIVE_ERRORS = ("gloo", "NCCL", "c10d", "Connection reset", "Connection closed", "Timed out")

#: Seconds between two liveness marks of a process (a thread of its own, so a long step does not
#: look like a lost process; a stopped or killed process stops marking).
LIVENESS_INTERVAL_S = 1.0


class Peers:
    """The job's processes agreeing on host-side decisions, over a gloo group of their own.

    Every method is a collective: every process calls it at the same point
    of the run, or the others wait (at most ``timeout_s``). In a single
    process each is the identity. CPU tensors only: the device stream is
    never waited on. A failed collective (a peer killed, stopped, or its
    host gone) raises :class:`PeerLost` naming the processes that stopped
    marking themselves alive in the job's store.
    """

    def __init__(self, processes: Processes, group: Any = None, timeout_s: float = 0.0, *,
                 owns_process_group: bool = False):
        self.processes, self.group, self.timeout_s = processes, group, timeout_s
        self.owns_process_group = owns_process_group  #: :func:`join` created the default group: close ends it
        self._liveness = _Liveness(processes) if group is not None else None

    @property
    def alone(self) -> bool:
        return self.group is None

    def _collective(self, run: Any) -> Any:
        try:
            return run()
        except (RuntimeError, ValueError) as exc:  # gloo: timeouts and closed connections
            raise PeerLost(self._lost(exc)) from exc

    def lost(self, exc: BaseException) -> PeerLost | None:
        """``exc`` as a :class:`PeerLost` when a collective of the job raised it (DDP's gradient
        all-reduce, the metrics' sums), else None: a bug of this process, which keeps its traceback."""
        if self.alone or not isinstance(exc, RuntimeError):
            return None
        import torch.distributed as dist

        text = str(exc)
        if isinstance(exc, dist.DistError) or any(word in text for word in _COLLECTIVE_ERRORS):
            return PeerLost(self._lost(exc))
        # A message octfw does not know (gloo inside DDP's all-reduce may say only "Application
        # timeout caused pair closure"): the liveness marks decide. A peer that stopped marking
        # itself alive was lost, whatever this process's collective said; with every peer alive,
        # it is this process's own bug.
        missing = self._liveness.missing() if self._liveness else None
        return PeerLost(self._lost(exc, missing)) if missing else None

    def _lost(self, exc: BaseException, missing: list[int] | None = None) -> str:
        if missing is None and self._liveness is not None:
            missing = self._liveness.missing()
        who = (f"the {'process' if len(missing) == 1 else 'processes'} of rank {', '.join(map(str, missing))}"
               if missing else "a process of the job")
        seen = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        seen = seen.split("] ", 1)[-1][:160]  # gloo's source location says nothing to a user
        return (f"{who} stopped answering (waited at most engine.collective_timeout_s = {self.timeout_s:g} s; "
                f"rank {self.processes.rank} saw: {seen})")

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every process (a run folder, a resume decision, a save's outcome)."""
        if self.alone:
            return value
        import torch.distributed as dist

        box = [value]
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def decide(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on rank 0, its result on every process. A UserError it raises (a folder in
        use, a lease held) is raised on every process: a refusal of the job, never a peer lost."""
        value, refusal = None, None
        if self.processes.is_main or self.alone:  # alone: no rank 0 to hear it from (a host tried on its own)
            try:
                value = decide()
            except UserError as exc:
                refusal = exc
        value, refused = self.broadcast((value, None if refusal is None else str(refusal)))
        if refusal is not None:
            raise refusal
        if refused is not None:
            raise UserError(refused)
        return value

    def max(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of every process's ``values`` (small counts and flags)."""
        if self.alone:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(list(values), dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group))
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value``, in rank order (rare: the reasons behind a shared stop)."""
        if self.alone:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.processes.world_size
        self._collective(lambda: dist.all_gather_object(values, value, group=self.group))
        return values

    def all_agree(self, ok: bool) -> bool:
        """True when ``ok`` is true on every process."""
        return not self.max([0 if ok else 1])[0]

    def barrier(self) -> None:
        self.max([0])

    def close(self) -> None:
        """Stop marking this process alive and end the process groups :func:`join` created. Left to
        the interpreter's exit, their threads ended the process in ``std::terminate`` ("terminate
        called without an active exception") on some runs; destroying a gloo group is local to this
        process, never a collective, so a peer lost does not hold it up."""
        if self._liveness is not None:
            self._liveness.stop()
        if self.owns_process_group:
            import torch.distributed as dist

            self.owns_process_group = False
            try:
                dist.destroy_process_group()  # the default group and every group made after it
            except Exception as exc:  # noqa: BLE001 - the process is ending; its outcome is decided
                logger.debug("ending the process group failed", exc_info=exc)


class _Liveness:
    """Each process marks itself alive in the job's store every second from a thread of its
    own; after a failed collective, the marks that stopped moving name the lost processes."""

    def __init__(self, processes: Processes):
        self.processes = processes
        self._store = self._connect()
        self._stopped = threading.Event()
        if self._store is not None:
            threading.Thread(target=self._mark, name="octfw-liveness", daemon=True).start()

    @staticmethod
    def _connect() -> Any:
        """A client of the job's store of its own (the training thread keeps the default one)."""
        import torch.distributed as dist

        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not (host and port):  # xla:// and other init methods: no named store; no names
            return None
        try:
            return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
        except (RuntimeError, ValueError) as exc:
            logger.debug("no liveness marks: the job's store at %s:%s did not answer", host, port, exc_info=exc)
            return None

    def _mark(self) -> None:
        beat = 0
        while not self._stopped.wait(LIVENESS_INTERVAL_S):
            beat += 1
            try:
                self._store.set(_alive_key(self.processes.rank), str(beat))
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to mark
                return

    def missing(self) -> list[int] | None:
        """The ranks whose mark did not move in three intervals; None when the store is gone too."""
        if self._store is None:
            return None
        others = [rank for rank in range(self.processes.world_size) if rank != self.processes.rank]
        return silent_ranks(self._store, others)

    def stop(self) -> None:
        self._stopped.set()


def _alive_key(rank: int) -> str:
    return f"octfw/alive/{rank}"


def silent_ranks(store: Any, ranks: Sequence[int], *, marked_only: bool = False) -> list[int] | None:
    """Which of ``ranks`` stopped marking themselves alive in the job's ``store`` (their mark did
    not move in three intervals: stopped, hung, killed, their host gone); None when the store
    cannot be read. The processes' own view after a failed collective, and the launcher's when
    a worker ends without a word (NCCL's watchdog ends the rank that waited, not the silent one).
    ``marked_only``: a rank that never marked is not counted (it may be starting)."""
    def read() -> dict[int, str | None]:
        return {rank: store.get(_alive_key(rank)).decode() if store.check([_alive_key(rank)]) else None
                for rank in ranks}

    try:
        before = read()
        time.sleep(3 * LIVENESS_INTERVAL_S)
        after = read()
    except Exception:  # noqa: BLE001 - the store lived with a lost process
        return None
    return [rank for rank in ranks if after[rank] == before[rank] and (before[rank] is not None or not marked_only)]
