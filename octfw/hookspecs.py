"""Hook specifications: one registration hook per stage.

Writing a plugin
----------------

One registration hook per stage: dataset, transform, model, scheduler, guard,
logger, checkpointer and evaluator.

A plugin is a module with one or more functions marked ``@hookimpl``. Each
registration hook receives a ``register`` callback; call it once per
component::

    import attrs
    from octfw.recipe.fields import doc, positive
    from octfw.hookspecs import Register, hookimpl
    from octfw.types import BuildContext

    @attrs.frozen
    class MyScheduleConfig:
        warmup_steps: int = doc("Linear warmup length in update steps.",
                                default=100, validator=positive)

    def build(config: MyScheduleConfig, ctx: BuildContext):
        from my_package.schedule import MySchedule   # heavy imports go here
        return MySchedule(config, ctx)

    @hookimpl
    def octfw_register_schedulers(register: Register) -> None:
        register("my-schedule", MyScheduleConfig, build,
                 "Warmup then inverse square root decay.")

and is announced in its distribution's ``pyproject.toml``::

    [project.entry-points.octfw]
    my_plugin = "my_package.octfw_plugin"

``register(name, config, factory, summary)``:

- ``name``: the component name used in recipes (``name = "my-schedule"``).
  ``(stage, name)`` is unique across all installed plugins; a clash is an
  error naming both distributions.
- ``config``: an attrs class; its fields are the component's recipe options.
  Recipes are structured into it with unknown keys refused, so an error names
  ``table.key``. Declare each field with :func:`octfw.recipe.fields.doc`: its text,
  default and validator are what ``octfw list --stage S --name N`` and the
  recipe reference show (a plain attribute docstring is not shown).
- ``factory``: ``factory(config, ctx) -> component``, a callable or a
  ``"module:function"`` string imported only when the component is built.
  ``ctx`` is an :class:`octfw.types.BuildContext`. What the factory returns
  is checked against its stage's protocol (:data:`octfw.types.STAGE_PROTOCOLS`)
  when it is built: a missing required method is refused before training.
- ``summary``: one line for ``octfw list``.

Keep the plugin module itself light (attrs only): ``octfw list`` and recipe
validation import every plugin module but build nothing.

Commands
--------

A plugin may also add subcommands to ``octfw`` (a dataset's own preparation
step: the built-in ``prepared`` dataset adds ``octfw prepare``) through
:meth:`OctfwSpecs.octfw_register_commands`::

    import argparse
    from octfw.hookspecs import RegisterCommand, hookimpl

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("folder", help="the folder to index")

    def run(args: argparse.Namespace) -> int:
        from my_package.index import write_index   # heavy imports go here
        write_index(args.folder)
        return 0

    @hookimpl
    def octfw_register_commands(register: RegisterCommand) -> None:
        register("my-index", add_arguments, run, "Index a folder of scans for my-dataset.")

``octfw --help`` lists it beside the built-in commands; ``octfw my-index
FOLDER`` runs it. A command name is unique among octfw's commands and every
installed plugin's: a clash is refused in one line naming both distributions
(exit code 2).

Hot path and syncs
------------------

"Hot path" below means code that runs on every micro-step or update step on
the training device. A device-to-host sync (``.item()``, ``float(t)``, Python
``if`` on a tensor) there stalls an accelerator and, on XLA, cuts the graph;
components in the hot path must never force one.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Protocol

import pluggy

__all__ = ["hookspec", "hookimpl", "Register", "RegisterCommand", "OctfwSpecs", "STAGES", "COMMANDS_HOOK"]

PROJECT = "octfw"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Register(Protocol):
    """The callback each registration hook receives."""

    def __call__(
        self,
        name: str,
        config: type,
        factory: Callable[[Any, Any], Any] | str,
        summary: str,
    ) -> None: ...


class RegisterCommand(Protocol):
    """The callback :meth:`OctfwSpecs.octfw_register_commands` receives: one call per command.

    - ``name``: the subcommand (``octfw NAME``): lower-case letters, digits and
      ``-``, starting with a letter. Unique among octfw's own commands and every
      installed plugin's.
    - ``add_arguments(parser)``: adds the command's arguments to its
      ``argparse.ArgumentParser`` (octfw makes the parser, named and described);
      called every time ``octfw`` starts, first on a parser of its own, so it
      only declares arguments. One that raises leaves that command out, reported
      like a failed registration; the other commands run.
    - ``run(args) -> int``: does the work with the parsed ``argparse.Namespace``
      and returns the exit code (0: done). A callable or a ``"module:function"``
      string imported only when the command runs. A
      :class:`octfw.display.errors.UserError` it raises is printed as one line and exits
      with its code (2); ``--debug`` shows the traceback.
    - ``summary``: what ``octfw --help`` shows beside the name and
      ``octfw NAME --help`` under the usage.
    """

    def __call__(
        self,
        name: str,
        add_arguments: Callable[[argparse.ArgumentParser], None],
        run: Callable[[argparse.Namespace], int] | str,
        summary: str,
    ) -> None: ...


class OctfwSpecs:
    """The hook specifications. Every hook is a broadcast: all plugins answer."""

    # --- data -------------------------------------------------------------

    @hookspec
    def octfw_register_datasets(self, register: Register) -> None:
        """Register dataset components (recipe table ``[dataset]``).

        The factory returns an :class:`octfw.types.Dataset`: ``len(ds)``,
        ``ds.load(i) -> Sample`` (float32 ``[D, H, W]`` numpy volume plus
        :class:`~octfw.types.Provenance`) and ``ds.domain(i) -> str``.

        Hot path: no. ``load`` runs in data-loader worker processes, off the
        training device; it never touches device tensors, so it cannot force
        a device sync. It raises :class:`octfw.display.errors.CorruptFile` for an
        unusable file, which octfw quarantines and replaces.

        :return: None; components are announced through ``register``.
        """

    @hookspec
    def octfw_register_transforms(self, register: Register) -> None:
        """Register transform components (recipe table ``[transform]``).

        The factory returns an :class:`octfw.types.Transform`:
        ``transform(sample, rng) -> dict`` of numpy arrays, and
        ``batch_spec() -> dict[str, BatchKey]`` declaring every key it returns
        (per-sample shape, dtype, whether it is a view): collate, the device
        transfer, SPMD sharding and ``octfw check`` follow the declaration.
        The built-in ``oct-standard`` makes :data:`octfw.types.BATCH_KEYS`
        (two views ``[C, D, H, W]`` and fixed-length patch index arrays). ``ctx.patch_size`` gives the model's
        patch grid. A transform config with an ``image_size`` field declares
        the model's input size.

        Hot path: no. Runs in data-loader workers on host arrays; cannot force
        a device sync.

        :return: None; components are announced through ``register``.
        """

    # --- model ------------------------------------------------------------

    @hookspec
    def octfw_register_models(self, register: Register) -> None:
        """Register model components (recipe table ``[model]``).

        The factory returns an :class:`octfw.types.Model`, in practice a
        ``torch.nn.Module``, whose ``forward(batch)`` takes the collated batch
        (a dict of device tensors keyed as the transform's ``batch_spec``,
        each with a leading batch dimension, plus
        :data:`octfw.types.DOMAIN_ID_KEY`, which a model may ignore) and
        returns an :class:`octfw.types.ModelOutput`. It declares the keys it
        reads in ``inputs`` (:attr:`octfw.types.Model.inputs`); a key the
        transform does not make is refused when the run is built. A model config with
        a ``patch_size`` field declares the patch grid.

        Optional capabilities, each a protocol the engine checks with
        ``isinstance``: :class:`~octfw.types.EMAModel` (``ema_update(momentum)``,
        momentum a device scalar; 1.0 means "leave the EMA as it is", which is
        how a skipped update leaves it untouched),
        :class:`~octfw.types.ParamGroupsModel` (``param_groups(weight_decay)``),
        :class:`~octfw.types.EmbeddingModel` (``embed``, for evaluators),
        :class:`~octfw.types.EncoderModel` (``encoder``, for export) and
        :class:`~octfw.types.CountingModel` (``count_parameters``).

        Hot path: yes, ``forward`` and ``ema_update`` run every step. They
        must not force a device-to-host sync, must gather tokens with
        fixed-size index tensors (no boolean-mask indexing) and must not
        branch in Python on tensor values.

        :return: None; components are announced through ``register``.
        """

    # --- optimisation -----------------------------------------------------

    @hookspec
    def octfw_register_schedulers(self, register: Register) -> None:
        """Register scheduler components (recipe table ``[scheduler]``).

        The factory returns an :class:`octfw.types.Schedule`: pure functions
        of the update step for the LR, weight decay and EMA momentum, with
        ``ctx.base_lr``, ``ctx.weight_decay`` and ``ctx.total_update_steps``
        known at build time. Pure functions cannot restart by accident, are
        simulated in full before training and resume exactly.

        Hot path: yes, called once per update step with a host int; returns host
        floats. Cannot force a device sync.

        :return: None; components are announced through ``register``.
        """

    @hookspec
    def octfw_register_guards(self, register: Register) -> None:
        """Register guard components (recipe array ``[[guard]]``).

        The factory returns an :class:`octfw.types.Guard`: both methods are
        required (a guard without one is refused when it is built).

        Hot path: yes. ``before_step`` runs on every update step, after the global gradient
        norm is measured and before the optimizer step; it returns a boolean
        device tensor (apply the update or not) or None, and must not force a
        sync: decide with ``torch.where`` on the device. ``at_log_step`` runs
        at log steps only with host values and may raise
        :class:`octfw.types.StopTraining` (a problem: the run stops, exit 1) or
        :class:`octfw.types.TrainingDone` (a target reached: the run is done,
        exit 0). The metric keys it receives are those of ``metrics.jsonl``
        (``loss``, ``grad_norm``, ``lr``, ``skipped_updates``, the model's
        ``metric/...``). All guards' verdicts are combined
        with a logical AND; on every rank the same verdict is taken.

        :return: None; components are announced through ``register``.
        """

    # --- output -----------------------------------------------------------

    @hookspec
    def octfw_register_loggers(self, register: Register) -> None:
        """Register logger components (recipe array ``[[logger]]``).

        The factory returns an :class:`octfw.types.Logger` (optionally a
        :class:`~octfw.types.StepListener`). Loggers exist on
        rank 0 only and receive host floats once per log step, read from the
        device in one transfer by the engine: a logger never forces a sync of
        its own.

        Hot path: no (log steps only).

        :return: None; components are announced through ``register``.
        """

    @hookspec
    def octfw_register_evaluators(self, register: Register) -> None:
        """Register evaluator components (recipe array ``[[evaluator]]``).

        The factory returns an :class:`octfw.types.Evaluator`: its
        ``every_steps`` (None: only at the end) and
        ``evaluate(model, device, update_step) -> dict[str, float]``, which
        measures the frozen encoder (for example a linear probe on pooled
        features of a labelled dataset) and returns host floats that are
        logged as ``eval/<name>/<metric>``.

        Hot path: no. Runs at its interval, between update steps, under
        ``torch.no_grad`` and with the training RNG state saved and restored
        by the engine, so a run with evaluation has the same training losses
        as one without. It may sync freely.

        :return: None; components are announced through ``register``.
        """

    @hookspec
    def octfw_register_checkpointers(self, register: Register) -> None:
        """Register checkpointer components (recipe table ``[checkpointer]``).

        The factory returns an :class:`octfw.types.Checkpointer`. ``save``
        receives the full training state as CPU tensors and plain data on
        rank 0 at checkpoint steps; it must be atomic and raise on failure.
        ``load`` must not be able to run code from the file (use
        ``torch.load(weights_only=True)``).

        Hot path: no (checkpoint steps only; the engine has already moved the
        state to the host).

        :return: None; components are announced through ``register``.
        """

    # --- commands ---------------------------------------------------------

    @hookspec
    def octfw_register_commands(self, register: RegisterCommand) -> None:
        """Register subcommands of ``octfw`` (``octfw NAME ...``); see :class:`RegisterCommand`.

        Called each time ``octfw`` starts, before the arguments are parsed, so
        that ``octfw --help`` lists every command. The module that implements
        it, and ``add_arguments``, import nothing heavy (argparse and octfw's
        light modules): ``octfw --help`` and ``octfw list`` import every plugin
        module. What the command needs (torch, Dask, a cloud client) is
        imported in ``run``, or ``run`` is a ``"module:function"`` string.

        A name taken by one of octfw's own commands or by another plugin's is
        refused when ``octfw`` starts, in one line naming both distributions
        (exit code 2); ``OCTFW_DISABLE_PLUGINS`` blocks a plugin. A plugin that
        fails to import or whose registration raises, or a command whose
        ``add_arguments`` raises, is reported by the commands that load the
        registry (``octfw list`` among them) and when its command is asked for,
        and the other commands still work.

        Hot path: no. Commands run outside training; nothing here touches a
        device tensor.

        :return: None; commands are announced through ``register``.
        """


#: The hook through which plugins add subcommands (the other hooks are :data:`STAGES`').
COMMANDS_HOOK = "octfw_register_commands"

#: Stage name -> (hook name, recipe table, whether the recipe takes several).
STAGES: dict[str, tuple[str, str, bool]] = {
    "dataset": ("octfw_register_datasets", "dataset", False),
    "transform": ("octfw_register_transforms", "transform", False),
    "model": ("octfw_register_models", "model", False),
    "scheduler": ("octfw_register_schedulers", "scheduler", False),
    "guard": ("octfw_register_guards", "guard", True),
    "logger": ("octfw_register_loggers", "logger", True),
    "checkpointer": ("octfw_register_checkpointers", "checkpointer", False),
    "evaluator": ("octfw_register_evaluators", "evaluator", True),
}
