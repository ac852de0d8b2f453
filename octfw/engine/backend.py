"""Device backends: CPU and CUDA through torch, TPU (or CPU in tests) through torch_xla, and the
module an update step calls on one (:func:`training_forward`: compiled, then wrapped in DDP or
sharded with FSDP2 over the job's processes, :mod:`octfw.engine.sharding`).

torch_xla is imported only when the ``xla`` device is chosen: importing it
patches ``torch.nn.utils.clip_grad_norm_`` for the whole process.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import attrs
import torch

from octfw.engine.attention import kernel_priority, priority_context
from octfw.engine.collate import float_views, view_keys, with_aliases
from octfw.engine.distributed import BatchLayout, Processes, layout_for, xla_spmd
from octfw.display.errors import UserError
from octfw.types import DOMAIN_ID_KEY, BatchKey

__all__ = ["Backend", "select_backend", "training_forward"]

def _tpu_present() -> bool:
    return any(Path("/dev").glob("accel*")) or Path("/dev/vfio").exists()


def resolve_device(requested: str) -> str:
    """``auto`` picks xla on a TPU host (or when PJRT_DEVICE asks for it), then cuda, then cpu."""
    if requested != "auto":
        return requested
    pjrt = os.environ.get("PJRT_DEVICE", "")
    if pjrt and pjrt.upper() != "CPU" or (not pjrt and _tpu_present()):
        return "xla"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@attrs.define
class Backend:
    """Where tensors live and how the host talks to that device."""

    kind: str  #: "cpu", "cuda" or "xla"
    device: torch.device
    precision: str  #: "fp32" or "bf16"
    rank: int = 0  #: this process among the data-parallel processes (DDP rank or SPMD host)
    world_size: int = 1  #: number of data-parallel processes
    local_devices: int = 1  #: devices this process drives (SPMD); 1 otherwise
    #: the SPMD device mesh: one axis "data", or ("data", "fsdp") with ``parallelism = "fsdp"``,
    #: whose "fsdp" axis splits parameters, gradients, optimizer state and EMA; None without SPMD
    mesh: Any = None
    #: ``engine.parallelism``: "data" (every process holds the whole model: DDP) or "fsdp"
    #: (parameters, gradients, optimizer state and EMA sharded over the processes: FSDP2)
    parallelism: str = "data"
    #: the attention kernels tried first, in order (:func:`~octfw.engine.attention.kernel_priority`);
    #: empty: torch's own order
    attention_priority: tuple[str, ...] = ()

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def across_processes(self) -> bool:
        """Gradients averaged over processes through torch.distributed, by DDP or FSDP (under
        SPMD, XLA inserts the all-reduce itself, and the hosts' gloo group carries host-side
        decisions only)."""
        return self.kind != "xla" and self.world_size > 1

    @property
    def sharded(self) -> bool:
        """Parameters, gradients, optimizer state and EMA sharded over the processes (FSDP2)."""
        return self.across_processes and self.parallelism == "fsdp"

    @property
    def sharded_on_mesh(self) -> bool:
        """The same over the SPMD mesh's "fsdp" axis (XLA places the gathers and reductions)."""
        return self.mesh is not None and self.parallelism == "fsdp"

    def accumulating(self, forward: torch.nn.Module, last_micro: bool) -> contextlib.AbstractContextManager:
        """Around a micro-step's forward and backward: gradients are reduced over the processes
        on the last micro-step of an update only, and accumulate locally before it."""
        if self.sharded:
            forward.set_requires_gradient_sync(last_micro)
        elif self.across_processes and not last_micro:
            return forward.no_sync()
        return contextlib.nullcontext()

    @property
    def device_count(self) -> int:
        """Devices taking part in data parallelism, over all processes."""
        return self.world_size * self.local_devices

    def batch_layout(self, per_device_batch: int, grad_accum_steps: int, global_batch: int | None = None, *,
                     kept: int | None = None) -> BatchLayout:
        """The global batch arithmetic of this run: processes x local devices x micro-steps
        (``global_batch`` pinned: the micro-steps derived from the devices found; else ``kept``,
        the global batch the run continued trains at, likewise)."""
        return layout_for(per_device_batch, grad_accum_steps, global_batch, processes=self.world_size,
                          devices_per_process=self.local_devices, kept=kept)

    def input_sharding(self, spec: Mapping[str, BatchKey]) -> dict[str, Any] | None:
        """SPMD: how each batch tensor goes onto the mesh; None without SPMD.

        The batch dimension is split over the mesh's one axis ``"data"``
        (all devices of all hosts); the other dimensions stay whole. With
        several processes (a multi-host slice) each host's loader yields only
        its own ``per_device_batch x local devices`` samples, and
        ``minibatch=True`` tells torch_xla that: the global tensor gets a
        batch of ``local batch x global devices / local devices``, each host
        filling the rows of its own devices. Without it torch_xla would take
        every host's local batch as the whole global batch.
        """
        if self.mesh is None:
            return None
        import torch_xla.distributed.spmd as xs

        ranks = {**{key: field.rank for key, field in spec.items()}, DOMAIN_ID_KEY: 0}
        batch_axis = ("data", "fsdp") if self.sharded_on_mesh else "data"  # the batch over every device
        return {key: xs.ShardingSpec(self.mesh, (batch_axis,) + (None,) * rank, minibatch=self.world_size > 1)
                for key, rank in ranks.items()}

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Around a model's forward: bf16 autocast where the precision asks for it, and the
        attention kernels this device tries first."""
        stack = contextlib.ExitStack()
        if self.precision == "bf16":
            stack.enter_context(torch.autocast(device_type=self.kind, dtype=torch.bfloat16))
        stack.enter_context(priority_context(self.attention_priority))
        return stack

    def device_batches(self, loader: Iterable[Mapping[str, Any]], spec: Mapping[str, BatchKey]
                       ) -> Iterator[Mapping[str, Any]]:
        """Batches (of the transform's ``spec``) with their tensors on the device, views as
        float32. On xla through the parallel loader, which uploads the next batch while the
        current one runs."""
        views = view_keys(spec)
        if self.kind == "xla":
            yield from self._xla_batches(loader, spec, views)
            return
        non_blocking = self.kind == "cuda"  # from the loader's pinned memory: the copy overlaps compute
        for batch in loader:
            tensors = {k: v.to(self.device, non_blocking=non_blocking) for k, v in batch["tensors"].items()}
            yield {**batch, "tensors": with_aliases(float_views(tensors, views), batch.get("aliases", {}))}

    def _xla_batches(self, loader: Iterable[Mapping[str, Any]], spec: Mapping[str, BatchKey],
                     views: tuple[str, ...]) -> Iterator[Mapping[str, Any]]:
        # The parallel loader moves only tensors; provenance travels beside it
        # in a FIFO, in the same order (one producer thread).
        import collections

        import torch_xla.distributed.parallel_loader as pl

        host_parts: collections.deque = collections.deque()

        def tensors_only() -> Iterator[dict[str, torch.Tensor]]:
            for batch in loader:
                host_parts.append({k: v for k, v in batch.items() if k != "tensors"})
                # Every input whole: the sharding specification names each key.
                yield with_aliases(batch["tensors"], batch.get("aliases", {}))

        sharding = self.input_sharding(spec)
        # The loader would cut the graph (torch_xla.sync) before every batch it
        # hands out, as a default for loops that never cut it themselves. The
        # engine cuts it where it wants: after each micro-step and at each
        # update step's end (Trainer.update), so the loader must not.
        never = sys.maxsize
        for tensors in pl.MpDeviceLoader(tensors_only(), self.device, input_sharding=sharding,
                                         batches_per_execution=never):
            yield {"tensors": float_views(tensors, views), **host_parts.popleft()}

    def step_boundary(self) -> None:
        """End of an update step or a micro-step: cut and launch the XLA graph; nothing elsewhere."""
        if self.kind == "xla":
            import torch_xla

            torch_xla.sync()

    def scalar(self, value: float) -> torch.Tensor:
        """A 0-d float32 device tensor holding the host value ``value`` (a
        scheduled momentum, say) as data that the graph reads, whatever the value."""
        if self.kind == "xla":
            # torch_xla compiles a 0-d tensor made from a host value of 0 or +-1
            # into the graph as a constant (its "special scalars"), any other
            # value as input data: the graph would compile anew the first time
            # the value hits 0 or 1, e.g. an EMA momentum reaching 1.0 at the
            # last update step. A one-element vector is always input data.
            # (XLA_NO_SPECIAL_SCALARS=1 would do it process-wide, also for
            # literals such as add's alpha=1 that XLA folds away today.)
            return torch.tensor([value], dtype=torch.float32, device=self.device).reshape(())
        # Filled on the device by a kernel that takes the value as an argument: no copy from
        # the host, so no host-device synchronisation (torch.tensor(value, device=cuda) copies
        # from pageable memory and waits for it).
        return torch.full((), value, dtype=torch.float32, device=self.device)

    def read(self, values: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Device tensors to host values in one transfer: a float per scalar,
        a list per vector. This is a sync point: the engine calls it on log
        steps only."""
        if not values:
            return {}
        flat = [values[name].detach().float().reshape(-1) for name in values]
        host = torch.cat(flat).cpu().tolist()
        out: dict[str, Any] = {}
        start = 0
        for name, tensor in zip(values, flat):
            n = tensor.numel()
            out[name] = host[start] if values[name].dim() == 0 else host[start:start + n]
            start += n
        return out

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings at log steps)."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.kind == "xla":
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()


def _xla_backend(precision: str, processes: Processes, parallelism: str = "data") -> Backend:
    import torch_xla
    import torch_xla.runtime as xr

    mesh, local = None, 1
    if xla_spmd():
        # SPMD (switched on by join() before the hosts' group and any XLA tensor; here for work
        # outside a training job): one process per host drives every local device; XLA inserts
        # the gradient all-reduce. The mesh spans the devices of every host (torch_xla requires
        # the global count); a host's own devices take its slice of the batch.
        import numpy as np
        import torch_xla.distributed.spmd as xs

        # With parallelism = "fsdp", a second axis "fsdp" over every device splits the model's
        # state (torch_xla's FSDPv2 layout); the batch is split over both axes.
        devices = xr.global_runtime_device_count()
        mesh = (xs.Mesh(np.arange(devices), (1, devices), ("data", "fsdp")) if parallelism == "fsdp"
                else xs.Mesh(np.arange(devices), (devices,), ("data",)))
        local = xr.addressable_runtime_device_count()
    return Backend(kind="xla", device=torch_xla.device(), precision=precision, rank=processes.rank,
                   world_size=processes.world_size, local_devices=local, mesh=mesh, parallelism=parallelism)


def require_torch_xla() -> None:
    """A one-line error, not an ImportError traceback, where torch_xla is missing."""
    try:
        import torch_xla  # noqa: F401
    except ImportError as exc:
        raise UserError(
            "run.device = \"xla\" needs torch_xla: pip install 'octfw[xla]' "
            f"(torch_xla 2.9.0 with torch 2.9.0); import failed: {exc}"
        ) from None


def refuse_compile_on_xla(compile: bool, kind: str) -> None:
    """engine.compile on xla is refused (the seeds' Inductor compile-worker storm): the one rule,
    for ``octfw run`` and ``octfw check`` alike, applied before torch_xla is imported."""
    if compile and kind == "xla":
        raise UserError("engine.compile = true is refused on xla (the Inductor compile-worker "
                        "storm); torch_xla compiles its graphs itself")


def resolved_precision(precision: str, kind: str) -> str:
    """engine.precision on a device of ``kind``: "auto" is fp32 on the CPU, bf16 autocast elsewhere."""
    if precision == "auto":
        return "fp32" if kind == "cpu" else "bf16"
    return precision


def select_backend(processes: Processes, precision: str, compile: bool = False,
                   parallelism: str = "data") -> Backend:
    """The backend of this process: its device was selected by :func:`octfw.engine.distributed.join`."""
    refuse_compile_on_xla(compile, processes.kind)
    precision = resolved_precision(precision, processes.kind)
    if processes.kind == "xla":
        return _xla_backend(precision, processes, parallelism)
    return Backend(kind=processes.kind, device=processes.device, precision=precision,
                   rank=processes.rank, world_size=processes.world_size, parallelism=parallelism,
                   attention_priority=kernel_priority(processes.device))


def single_process_backend(requested: str, precision: str, compile: bool = False) -> Backend:
    """A backend for work outside a training job (evaluation, replay): this process alone."""
    return select_backend(this_process(requested), precision, compile)


def this_process(requested: str) -> Processes:
    """This process alone on the ``run.device`` asked for (no job, no peers)."""
    kind = resolve_device(requested)
    if kind == "xla":
        require_torch_xla()
    elif kind == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device = \"cuda\" but torch sees no CUDA device; use \"cpu\" or \"auto\"")
    if kind == "xla":  # the host's place in the runtime, as torch_xla reports it; no peers to agree with
        from octfw.engine.distributed import xla_processes

        return xla_processes()
    return Processes(kind, {"cpu": torch.device("cpu"), "cuda": torch.device("cuda", 0)}[kind])


def training_forward(model: torch.nn.Module, backend: Backend, *, compile: bool,
                     reshard_after_forward: bool = True) -> torch.nn.Module:
    """What an update step calls: ``model``, compiled and wrapped in DDP, or sharded, as asked.
    Made before the optimizer: a sharded model's parameters are its slices.

    Compiled, then wrapped: ``DDP(torch.compile(model))``, as PyTorch's "Where
    to apply torch.compile?" advises (compile the module passed to the wrapper;
    ``torch.compile`` does not handle DDP's own forward well). DDPOptimizer
    still splits the graph at DDP's gradient buckets, so all-reduces overlap
    the backward: dynamo compiles the model's frame inside DDP's forward, where
    it finds the active DDP module and its bucket size. Wrapped the other way
    round, dynamo breaks the graph twice in ``DDP.forward`` (its logger and
    ``_inside_ddp_forward``) and splits the model's graph the same
    (``tests/test_compile.py`` checks the split). A separate compiled module rather
    than ``model.compile()``: ``model`` stays eager for the FLOP count on meta
    tensors, the evaluators and export. Sharded (FSDP2, :mod:`octfw.engine.sharding`), the
    model itself is what runs: ``fully_shard`` changes it in place, and ``compile`` compiles each
    block before it is sharded, as torchtitan does.
    """
    if backend.sharded:
        from octfw.engine.sharding import shard_model

        return shard_model(model, precision=backend.precision, reshard_after_forward=reshard_after_forward,
                           compile=compile)
    if backend.sharded_on_mesh:
        from octfw.engine.sharding import shard_on_mesh

        return shard_on_mesh(model, backend.mesh)
    forward = torch.compile(model) if compile else model
    if backend.across_processes:  # gradients averaged across the processes
        forward = torch.nn.parallel.DistributedDataParallel(forward)
    return forward
