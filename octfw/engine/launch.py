"""Start one training job: join the job's processes, plan the run, train.

``octfw run``, ``octfw.train`` and ``octfw bench`` (each grid point in its
own process) start training here. Every process of the job works out who it
is once (:func:`octfw.engine.distributed.join`, device first), hears the same
:class:`~octfw.engine.plan.RunPlan` (:func:`octfw.engine.plan.planned_run`:
which folder, which checkpoint), and trains it. While it trains, rank 0
writes the run's ``octfw.log`` (:func:`octfw.display.logs.attach_run_log`).
"""

from __future__ import annotations

from octfw.engine.backend import require_torch_xla, resolve_device
from octfw.engine.distributed import PeerLost, join
from octfw.engine.plan import AlreadyFinished, planned_run
from octfw.engine.preemption import StopRequests
from octfw.engine.trainer import RunSummary, Trainer
from octfw.display.logs import attach_run_log, detach_run_log
from octfw.recipe import Recipe
from octfw.registry import Registry

__all__ = ["launch", "AlreadyFinished"]


def launch(recipe: Recipe, registry: Registry, resume: str | None = None,
           stop_requests: StopRequests | None = None, allow_recipe_change: bool = False) -> RunSummary:
    """Train ``recipe``; ``resume`` is None, ``"auto"`` or a checkpoint location
    (:mod:`octfw.engine.plan`). Raises :class:`AlreadyFinished` when ``auto`` has nothing to do.
    ``stop_requests``: the command's signal handling, installed since it started.
    ``allow_recipe_change``: continue a run with a recipe that trains otherwise."""
    kind = resolve_device(recipe.run.device)
    if kind == "xla":
        require_torch_xla()
    processes, peers = join(kind, recipe.engine.collective_timeout_s)
    try:
        with planned_run(recipe, registry, resume=resume, processes=processes, peers=peers,
                         stop_requests=stop_requests, allow_recipe_change=allow_recipe_change) as plan:
            run_log = attach_run_log(plan.run_dir) if processes.is_main else None
            try:
                return Trainer(plan, registry, peers=peers, stop_requests=stop_requests).run()
            finally:
                if run_log is not None:
                    detach_run_log(run_log)
    except Exception as exc:
        # A collective of the build (DDP's first broadcast) that met a peer gone: not this process's bug.
        lost = None if isinstance(exc, PeerLost) else peers.lost(exc)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        peers.close()
