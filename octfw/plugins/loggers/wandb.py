"""``wandb``: one Weights & Biases run per training job, continued on resume.

- Rank 0 only: the engine builds loggers on rank 0, and this logger also does
  nothing on any other rank, so a 16-worker job makes one run, not sixteen.
- One run per job: the run id is part of :meth:`WandbLogger.state_dict`, which
  the engine stores in every checkpoint; ``octfw run --resume`` restores it
  before :meth:`WandbLogger.start`, which then continues that run
  (``wandb.init(id=..., resume="allow")``). A second W&B run active in the
  same process is refused rather than silently started.
- Offline without network: ``mode = "offline"`` (or ``WANDB_MODE=offline``)
  writes ``<dir>/wandb/offline-run-<time>-<id>/``, to upload later with
  ``wandb sync``. An offline resume writes a second folder with the same run
  id; ``wandb sync`` merges them into the one run.
- ``start`` gives W&B the resolved recipe as the run's config; ``log`` sends
  exactly the host floats the engine hands over, at ``step = update_step``;
  ``finish`` uploads what ``log_artifacts`` names as model artifacts (the
  newest checkpoint, the run's exported ``encoder/``), writes the run summary
  (failed saves, first and last loss, ...) into the W&B summary and closes
  the run.

When the run is resumed from a checkpoint older than the last logged step,
W&B ignores (with a warning) the steps it already has; the values it keeps
are those of the first attempt.

``mode`` left out follows ``WANDB_MODE``, and W&B's own default (online,
which needs ``wandb login`` or ``WANDB_API_KEY``) when that is unset: the
choice stays with the machine's environment, as W&B users expect.

W&B's own ``wandb: ...`` lines (where the run is saved, the history and
summary tables at the end: some 40 lines) stay off the console, as other
libraries' output does: they go, with the records of its ``wandb`` logger, to
the run's ``octfw.log`` (see :mod:`octfw.display.logs`), with the id and folder of the
W&B run this job logs to. W&B's errors still show on the console.

Needs the ``wandb`` extra: ``pip install 'octfw[wandb]'``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import attrs

from octfw.display.errors import UserError
from octfw.recipe.fields import Location, choices, doc
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext

__all__ = ["WandbConfig", "WandbLogger", "build", "import_wandb"]

MODES = ("online", "offline", "disabled")
#: What ``log_artifacts`` may upload at the end of the run, and the summary key that says where it is.
ARTIFACTS = {"checkpoint": "checkpoint", "encoder": "encoder"}

logger = logging.getLogger(__name__)


def _mode(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None:
        choices(*MODES)(instance, attribute, value)


@attrs.frozen
class WandbConfig:
    """Config of the ``wandb`` logger."""

    project: str = doc("W&B project", default="octfw")
    entity: str | None = doc("W&B entity (user or team); leave out for your default entity", default=None)
    run_name: str | None = doc(
        "display name of the W&B run; leave out for <recipe name>-<run folder name>", default=None
    )
    group: str | None = doc("W&B group: runs of one experiment shown together (seeds, a sweep)", default=None)
    job_type: str | None = doc("W&B job type, e.g. 'pretrain'; leave out for W&B's default", default=None)
    notes: str | None = doc("a longer description of the run, shown on its W&B page", default=None)
    tags: tuple[str, ...] = doc("tags of the run", default=())
    mode: str | None = doc(
        "'online', 'offline' (no network; upload later with `wandb sync`) or 'disabled'; "
        "leave out to follow WANDB_MODE (W&B's default: online)",
        default=None,
        validator=_mode,
    )
    dir: Location | None = doc(
        "local folder that receives W&B's files (a wandb/ folder inside it); leave out for the run folder",
        default=None,
    )
    log_artifacts: tuple[str, ...] = doc(
        "what to upload as W&B model artifacts when the run ends: 'checkpoint' (the newest checkpoint; "
        "one on gs:// is logged as a reference) and 'encoder' (RUN/encoder, written when "
        "run.export_encoder is on); named <what>-<run id>, aliased 'latest' and 'step-<N>'",
        default=(),
        validator=attrs.validators.deep_iterable(choices(*ARTIFACTS)),
    )


def import_wandb() -> Any:
    """The wandb module, or a UserError naming the extra that installs it."""
    try:
        import wandb
    except ImportError:
        raise UserError("the 'wandb' logger needs the wandb package: pip install 'octfw[wandb]'") from None
    return wandb


class WandbLogger:
    """Logs to one W&B run; its id travels in the checkpoint so a resume continues the run."""

    def __init__(self, config: WandbConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.run_id: str | None = None  #: set by start(), or by load_state_dict() on resume
        self._run: Any = None

    # --- checkpointed state ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run_id = state["run_id"]

    # --- the Logger protocol ------------------------------------------------

    def start(self, total_update_steps: int, run_dir: Path, recipe: Mapping[str, Any]) -> None:
        if self.rank != 0:
            return
        wandb = import_wandb()
        if wandb.run is not None:
            raise UserError(
                f"wandb logger: W&B run {wandb.run.id} is already active in this process; one training "
                "job is one W&B run (is [[logger]] name = \"wandb\" listed twice?)"
            )
        c = self.config
        run_dir = Path(run_dir)
        folder = Path(c.dir.local_path) if c.dir is not None else run_dir
        folder.mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {
            "project": c.project,
            "entity": c.entity,
            "name": c.run_name or f"{run_dir.parent.name}-{run_dir.name}",
            "group": c.group,
            "job_type": c.job_type,
            "notes": c.notes,
            "tags": list(c.tags),
            "dir": str(folder),
            "config": dict(recipe),
        }
        if c.mode is not None:
            options["mode"] = c.mode
        if self.run_id is not None:  # resumed from a checkpoint: continue that run
            options.update(id=self.run_id, resume="allow")
        # W&B prints its notes and warnings to stderr itself. With show_info and show_warnings
        # off it hands them to termsetup's fallback logger instead: "wandb", which octfw.display.logs
        # sends to octfw.log only. After setup(), whose first call sets up W&B's terminal anew.
        wandb.setup()
        wandb.termsetup(wandb.Settings(show_info=False, show_warnings=False), logging.getLogger("wandb"))
        try:
            self._run = wandb.init(**options)
        except Exception as exc:  # noqa: BLE001 - re-raised as a message the user can act on
            _restore_terminal(wandb)
            raise UserError(
                f"wandb logger: wandb.init failed ({type(exc).__name__}: {exc}); log in with `wandb login`, "
                "or set mode = \"offline\" in the [[logger]] table (or WANDB_MODE=offline) to log without network"
            ) from exc
        self.run_id = self._run.id
        logger.debug("W&B run %s (%s) in %s", self.run_id,
                     "continued" if "resume" in options else "new", folder)

    def log(self, update_step: int, metrics: Mapping[str, float]) -> None:
        if self._run is not None:
            self._run.log(dict(metrics), step=int(update_step))

    def finish(self, summary: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        for what in self.config.log_artifacts:
            self._log_artifact(what, summary.get(ARTIFACTS[what]), int(summary.get("update_steps") or 0))
        for key, value in summary.items():
            if value is not None:  # never turn a missing value into the string "None"
                self._run.summary[key] = value
        self._run.finish(exit_code=1 if summary.get("stopped") else 0)
        self._run = None
        _restore_terminal(import_wandb())

    def _log_artifact(self, what: str, location: str | None, update_step: int) -> None:
        """One model artifact: a local file or folder uploaded, a remote object referenced."""
        if location is None:
            logger.warning("wandb logger: log_artifacts names %r, but this run has none to upload", what)
            return
        wandb = import_wandb()
        artifact = wandb.Artifact(f"{what}-{self.run_id}", type="model",
                                  metadata={"update_step": update_step, "location": location})
        if "://" in location:
            artifact.add_reference(location)
        elif Path(location).is_dir():
            artifact.add_dir(location)
        else:
            artifact.add_file(location)
        self._run.log_artifact(artifact, aliases=["latest", f"step-{update_step}"])
        logger.info("wandb logger: %s %s logged as artifact %s-%s", what, location, what, self.run_id)


def _restore_terminal(wandb: Any) -> None:
    """W&B's terminal output as its own settings make it, for W&B used after this run in the process."""
    wandb.termsetup(wandb.setup().settings, None)


def build(config: WandbConfig, ctx: BuildContext) -> WandbLogger:
    if config.dir is not None and config.dir.is_remote:
        raise UserError(f"logger wandb: dir = {str(config.dir)!r} must be a local folder")
    if ctx.is_main_process:
        import_wandb()  # a missing package fails at build time, before training starts
    return WandbLogger(config, rank=ctx.rank)


@hookimpl
def octfw_register_loggers(register: Register) -> None:
    register(
        "wandb",
        WandbConfig,
        build,
        "Weights & Biases, rank 0 only: one run per job, its id kept in checkpoints to "
        "continue on resume.",
    )
