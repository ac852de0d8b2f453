"""The full training state: what a checkpoint holds and how a run resumes from it.

Everything is converted to CPU tensors and plain Python data so that the
checkpointer can load it with ``torch.load(weights_only=True)``. The copy is
a real copy, even of tensors already on the CPU: a background save
(:mod:`octfw.engine.checkpointing`) serialises it while training goes on and
changes the parameters in place. A sharded run copies each process's own
slices instead (:meth:`TrainingState.slices`); read back, the checkpoint is
the same whole state, which :func:`restore` splits as the resuming model is split.

A checkpoint also records what it cannot be resumed without: the recipe's
model table, the global batch (the schedule and the data order count in it)
and the dataset's fingerprint. :func:`restore` refuses a checkpoint whose
model or global batch differ, and a dataset with another number of samples;
a dataset with as many samples but other files is resumed with a warning
(files replaced one for one, for example re-exported DICOM, keep the order).
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any, Callable

import numpy as np
import torch

from octfw.engine.build import Components
from octfw.engine.distributed import BatchLayout
from octfw.engine.sharding import is_sharded, shard_like, shard_optimizer_state
from octfw.display.errors import UserError
from octfw.display.tables import counted
from octfw.recipe.changes import recipe_changes
from octfw.storage.checkpoint_names import is_sharded_checkpoint
from octfw.types import NamingDataset, ShardedCheckpointer, Stateful

__all__ = ["TrainingState", "restore", "host_copy", "dataset_fingerprint", "checkpoint_nbytes"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def host_copy(value: Any) -> Any:
    """CPU copies of every tensor in ``value`` (dicts, lists and tuples walked). A sharded
    tensor is gathered whole first: a collective, so every process of the job copies alike."""
    if is_sharded(value):
        value = value.full_tensor()
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


def checkpoint_nbytes(model: torch.nn.Module, parameters: list[torch.Tensor]) -> int:
    """About what a checkpoint of this model takes before the first one is written: the
    model's state (weights, buffers, an EMA copy) plus AdamW's two float32 moments."""
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return model_bytes + sum(2 * 4 * p.numel() for p in parameters)


def dataset_fingerprint(dataset: Any) -> dict[str, Any]:
    """How many samples, and a hash of their names where the dataset can name them."""
    size = len(dataset)
    if not isinstance(dataset, NamingDataset):
        return {"samples": size, "sha256": None}
    digest = hashlib.sha256()
    for index in range(size):
        digest.update(str(dataset.url(index)).encode() + b"\n")
    return {"samples": size, "sha256": digest.hexdigest()}


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])


def _component_states(components: list[Any]) -> list[Any]:
    return [c.state_dict() if isinstance(c, Stateful) else None for c in components]


class TrainingState:
    """The run's training state as a checkpoint takes it, after update step ``done``: whole
    (:meth:`whole`) or as each process of a sharded run writes it (:meth:`slices`).
    ``samples_done(done)`` and ``first_loss()``: the loop's count and its first logged loss,
    which the run's summary carries across attempts; ``main``: rank 0, which alone saves the
    plain part."""

    def __init__(self, parts: Components, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 layout: BatchLayout, fingerprint: dict[str, Any], samples_done: Callable[[int], int],
                 first_loss: Callable[[], float | None], main: bool):
        self.parts, self.model, self.optimizer, self.layout, self.fingerprint = (
            parts, model, optimizer, layout, fingerprint)
        self.samples_done, self.first_loss, self.main = samples_done, first_loss, main

    def _plain(self, done: int) -> dict[str, Any]:
        """Everything a checkpoint holds but the model's and the optimizer's state."""
        from octfw.runs.folder import versions

        return {
            "format": FORMAT_VERSION,
            "update_step": done,
            "samples_done": self.samples_done(done),
            "global_batch": self.layout.global_batch,
            "devices": self.layout.devices,
            "dataset": self.fingerprint,
            "guards": host_copy(_component_states(self.parts.guards)),
            "loggers": host_copy(_component_states(self.parts.loggers)),
            "rng": host_copy(_rng_state()),
            "recipe": self.parts.ctx.recipe,
            "versions": versions(),
            "run": {"first_loss": self.first_loss()},
        }

    def whole(self, done: int) -> dict[str, Any]:
        """The state as a host copy the loop no longer touches; a sharded model's is gathered
        (a collective: every process calls it)."""
        return {**self._plain(done), "model": host_copy(self.model.state_dict()),
                "optimizer": host_copy(self.optimizer.state_dict())}

    def slices(self, done: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The state as each process of a sharded run saves it (a
        :class:`~octfw.types.ShardedCheckpointer`), gathering nothing: (this process's slices of
        the model's and the optimizer's tensors, copied to the host; the rest of :meth:`whole`'s
        state on rank 0, None elsewhere). Read back, the two are :meth:`whole`'s state."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        optimizer_state = self.optimizer.state_dict()
        # A synchronous copy of each process's own slices to plain host memory, sharding kept.
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
        shards = stager.stage({"model": self.model.state_dict(), "optimizer": {"state": optimizer_state["state"]}})
        if not self.main:
            return shards, None
        return shards, {**self._plain(done), "optimizer": {"param_groups": host_copy(optimizer_state["param_groups"])}}


def _refuse_incompatible(state: dict[str, Any], where: str, parts: Components,
                         layout: BatchLayout, fingerprint: dict[str, Any]) -> None:
    """Refuse what cannot be resumed exactly; warn about what can (see the module docstring)."""
    recorded_model = dict((state.get("recipe") or {}).get("model") or {})
    current_model = dict(parts.ctx.recipe.get("model") or {})
    # A model key whose change leaves the training as it was (how memory is spent, how published
    # weights are loaded) or that a checkpoint predates is no other model: recipe.changes' rules.
    changed = [c for c in recipe_changes({"model": recorded_model}, {"model": current_model}) if c.trains]
    if recorded_model and changed:
        diff = ", ".join(f"{c.key} {c.values[0]!r} -> {c.values[1]!r}" for c in changed)
        raise UserError(f"--resume {where}: the checkpoint was trained with another model ({diff})")
    saved_batch, saved_devices = state.get("global_batch"), state.get("devices")
    if saved_batch is not None and saved_batch != layout.global_batch:
        engine = parts.ctx.recipe.get("engine") or {}
        pinned = engine.get("global_batch")
        if saved_devices is not None and saved_devices != layout.devices and pinned is None:
            # Another launch, not another recipe. Both ways out are runs the next check takes.
            raise UserError(
                f"--resume {where}: the checkpoint was trained on {counted(saved_devices, 'device')} (global batch "
                f"{saved_batch}), this run has {counted(layout.devices, 'device')} (global batch "
                f"{layout.global_batch}); run it on {counted(saved_devices, 'device')} as it was launched "
                f"(--nproc-per-node){_keep_batch(saved_batch, layout, engine, ', or ')}")
        if pinned is not None:
            raise UserError(
                f"--resume {where}: the checkpoint was trained with a global batch of "
                f"{counted(saved_batch, 'sample')}, this run pins engine.global_batch = {pinned}; the schedule and "
                f"the data order count in it{_keep_batch(saved_batch, layout, engine, '; ')}")
        raise UserError(
            f"--resume {where}: the checkpoint was trained with a global batch of {counted(saved_batch, 'sample')}, "
            f"this run has {layout.global_batch} (per_device_batch x devices x grad_accum_steps); "
            "the schedule and the data order count in it, so the run would not continue as it was")
    saved_data = state.get("dataset")
    if saved_data is None:
        return
    if saved_data["samples"] != fingerprint["samples"]:
        raise UserError(
            f"--resume {where}: the checkpoint's dataset had {counted(saved_data['samples'], 'sample')}, this one has "
            f"{fingerprint['samples']}; the data order and the epoch count depend on it. Start a new run "
            "(or restore the dataset)")
    if saved_data["sha256"] != fingerprint["sha256"]:
        logger.warning("--resume %s: the dataset has as many samples as the checkpoint's but other files; "
                       "training continues with them in the same order", where)


def _keep_batch(saved_batch: int, layout: BatchLayout, engine: dict[str, Any], joined: str) -> str:
    """How this run keeps the checkpoint's global batch on its devices, after ``joined``: the
    settings to pin (``engine.grad_accum_steps`` back to 1 where the recipe sets it, as a pinned
    batch requires; neither is a change of training: :func:`octfw.engine.resume.check_recipe_change`);
    or, in brackets, why pinning cannot (the batch does not divide over these devices)."""
    per_micro_step = layout.per_device_batch * layout.devices
    if saved_batch % per_micro_step:
        return (f" (pinning engine.global_batch = {saved_batch} cannot keep it here: it does not divide over "
                f"{counted(layout.devices, 'device')} x engine.per_device_batch {layout.per_device_batch})")
    settings = f"engine.global_batch = {saved_batch}"
    if engine.get("global_batch") is None and engine.get("grad_accum_steps", 1) != 1:
        settings += " and engine.grad_accum_steps = 1"
    return f"{joined}pin {settings} to derive the accumulation from the devices"


def _names(recipe: Any, stage: str) -> list[str] | None:
    """The component names of a stage array in a resolved recipe (None: not recorded)."""
    if not isinstance(recipe, dict):
        return None
    return [table.get("name") for table in recipe.get(stage) or []]


def _read(location: str, parts: Components, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          layout: BatchLayout, fingerprint: dict[str, Any], sharded: bool) -> dict[str, Any]:
    """The checkpoint's whole state, checked to be one this run can continue. A sharded run
    reading a sharded checkpoint takes only its own slices, filled in place (whatever number
    of processes wrote them); anything else is read whole, and split below."""
    def check(state: Any) -> None:
        if not isinstance(state, dict) or "update_step" not in state or "recipe" not in state:
            raise UserError(f"--resume {location}: not an octfw training checkpoint")
        _refuse_incompatible(state, location, parts, layout, fingerprint)

    checkpointer = parts.checkpointer
    if sharded and is_sharded_checkpoint(location) and isinstance(checkpointer, ShardedCheckpointer):
        # AdamW's moments, sliced as their parameters are, for the checkpoint's to be read into
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        moments = {index: {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                   for index, p in enumerate(parameters)}
        return checkpointer.load_sharded(location, {"model": model.state_dict(), "optimizer": {"state": moments}},
                                         check, optional=("optimizer.",))
    state = checkpointer.load(location)
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"--resume {location}: not an octfw training checkpoint")
    check(state)
    return state


def restore(location: str, parts: Components, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
            layout: BatchLayout, fingerprint: dict[str, Any], sharded: bool = False) -> tuple[int, dict[str, Any]]:
    """Load the checkpoint at ``location`` into the built components (``sharded``: the model is
    sliced over the processes, FSDP2); returns
    (update_step, the run's record: ``TrainingState``'s ``run`` and, as ``recipe`` and
    ``global_batch``, the resolved recipe that trained it and the global batch it trained at).
    A file that cannot be read (cut short, not a checkpoint) is a user error naming it, never a
    partial load."""
    try:
        state = _read(location, parts, model, optimizer, layout, fingerprint, sharded)
    except FileNotFoundError:
        raise UserError(f"--resume {location}: checkpoint not found") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UserError(f"--resume {location}: cannot be read as a checkpoint "
                        f"({type(exc).__name__}: {first})") from None
    _refuse_incompatible(state, location, parts, layout, fingerprint)
    try:  # a checkpoint holds the full state; a sharded model takes its slices of it
        model.load_state_dict(shard_like(state["model"], model.state_dict()))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"--resume {location}: its weights do not fit this model ({first})") from None
    saved = state["optimizer"]
    # A sharded checkpoint's nested keys are strings: the moments of parameter "0" are parameter 0's.
    saved = {**saved, "state": {int(index): moments for index, moments in saved["state"].items()}}
    if len(saved["param_groups"]) != len(optimizer.param_groups):  # torch's own error is a traceback
        raise UserError(
            f"--resume {location}: the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, "
            f"this model makes {len(optimizer.param_groups)}"
            + (": it was written before model.predictor_warmup_steps held the encoder in groups of its own; set "
               "model.predictor_warmup_steps = 0 to continue it as it trained"
               if "predictor_warmup_steps" not in ((state.get("recipe") or {}).get("model") or {}) else ""))
    optimizer.load_state_dict(shard_optimizer_state(saved, optimizer))
    for stage, components, saved_states in (("guard", parts.guards, state["guards"]),
                                            ("logger", parts.loggers, state["loggers"])):
        if _names(state.get("recipe"), stage) != _names(parts.ctx.recipe, stage):
            continue  # the stage's components changed (an accepted recipe change): each starts afresh
        for component, saved in zip(components, saved_states):
            if saved is not None and isinstance(component, Stateful):
                component.load_state_dict(saved)
    _set_rng_state(state["rng"])
    return int(state["update_step"]), {**(state.get("run") or {}), "recipe": state.get("recipe"),
                                       "global_batch": state.get("global_batch")}
