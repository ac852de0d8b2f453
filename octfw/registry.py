"""Plugin manager factory, the component registry and the plugins' commands.

No plugin manager exists at import time: :func:`make_plugin_manager` builds a
fresh one (tests get their own), :func:`load_registry` asks every plugin
to register its components and :func:`load_commands` its subcommands of
``octfw``. Built-in components come from the modules in
:data:`BUILTIN_PLUGINS`; third-party ones from the entry-point group
``octfw``. Both go through the same hooks.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import importlib.metadata as metadata
import logging
import os
from typing import Any, Callable, Iterable

import attrs
import pluggy

from octfw import hookspecs
from octfw.display.errors import PluginError, UserError
from octfw.types import STAGE_PROTOCOLS, missing_members, protocol_members

__all__ = [
    "ENTRY_POINT_GROUP",
    "Component",
    "Command",
    "PluginFailure",
    "Registry",
    "make_plugin_manager",
    "load_registry",
    "load_commands",
    "did_you_mean",
]

ENTRY_POINT_GROUP = "octfw"
DISABLE_ENV = "OCTFW_DISABLE_PLUGINS"
BUILTIN_DISTRIBUTION = "octfw"

#: The built-in components, one module each (a component's config, code and
#: registration live together: docs/architecture.md), in the order
#: ``octfw list`` shows them within a stage. Imported by name so that the
#: registry (a low layer) never imports a component statically.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "octfw.plugins.datasets.dicom",
    "octfw.plugins.datasets.synthetic",
    "octfw.plugins.datasets.phantom",
    "octfw.plugins.datasets.vendor",
    "octfw.plugins.datasets.prepared",
    "octfw.plugins.transforms.oct_standard",
    "octfw.plugins.models.vjepa3d",
    "octfw.plugins.models.mae3d",
    "octfw.plugins.schedulers.cosine",
    "octfw.plugins.schedulers.constant",
    "octfw.plugins.guards.nan_skip",
    "octfw.plugins.guards.grad_clip",
    "octfw.plugins.guards.lr_positive",
    "octfw.plugins.guards.loss_spike",
    "octfw.plugins.guards.collapse",
    "octfw.plugins.loggers.console",
    "octfw.plugins.loggers.jsonl",
    "octfw.plugins.loggers.wandb",
    "octfw.plugins.loggers.tensorboard",
    "octfw.plugins.checkpointers.local",
    "octfw.plugins.checkpointers.gcs",
    "octfw.plugins.evaluators.linear_probe",
    "octfw.plugins.evaluators.knn",
    "octfw.plugins.evaluators.attentive_probe",
    "octfw.plugins.evaluators.fine_tune",
    "octfw.plugins.evaluators.dense_probe",
    "octfw.plugins.evaluators.layer_segmentation",
)


@attrs.frozen
class Component:
    """One registered component: what ``octfw list`` shows and what a recipe names."""

    stage: str
    name: str
    config: type
    factory: Callable[[Any, Any], Any] | str
    summary: str
    distribution: str  #: the distribution that ships it ("octfw" for built-ins)
    version: str
    plugin: str  #: the plugin module (or entry-point name) that registered it

    def build(self, config: Any, ctx: Any) -> Any:
        """Make the component and check it against its stage's protocol. A
        ``"module:function"`` factory is imported now.

        A component that lacks a member its stage's protocol
        (:data:`octfw.types.STAGE_PROTOCOLS`) requires is refused here, before
        training, with one PluginError naming the members, the component and
        its distribution: not an AttributeError at the first update step.

        A third-party factory that raises anything but a UserError is reported
        as one PluginError naming the component, its stage and distribution
        (the user's fix is in that plugin, not in octfw); its traceback goes to
        the debug log (the run's ``octfw.log``, or the console with
        ``--debug``). A built-in one keeps its traceback: that is octfw's bug.
        """
        try:
            factory = self.factory
            if isinstance(factory, str):
                module_name, _, attr = factory.partition(":")
                factory = getattr(importlib.import_module(module_name), attr)
            component = factory(config, ctx)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken plugin is named, not a traceback
            if self.distribution == BUILTIN_DISTRIBUTION:
                raise
            logging.getLogger(__name__).debug("%s %r failed to build", self.stage, self.name, exc_info=True)
            first_line = (str(exc).strip().splitlines() or [""])[0]  # the console gets one line
            raise PluginError(
                f"{self.stage} {self.name!r} from {self.distribution} {self.version} failed to build: "
                f"{type(exc).__name__}: {first_line} (octfw --debug shows the traceback)"
            ) from None
        self.check(component)
        return component

    def check(self, component: Any) -> None:
        """Refuse a built component that lacks a required member of its stage's protocol."""
        protocol = STAGE_PROTOCOLS.get(self.stage)
        missing = missing_members(component, protocol) if protocol is not None else []
        if missing:
            required = ", ".join(protocol_members(protocol))
            raise PluginError(
                f"{self.stage} {self.name!r} from {self.distribution} {self.version} lacks "
                f"{', '.join(missing)}, which every {self.stage} must have (octfw.types.{protocol.__name__}: "
                f"{required}; built a {type(component).__name__}); see 'Writing a plugin' in octfw's README"
            )


@attrs.frozen
class PluginFailure:
    """A third-party plugin that could not be imported or registered, or, with ``command``, one
    of its commands that could not add its arguments (left out; the plugin's other commands and
    its components work)."""

    distribution: str
    entry_point: str
    error: str
    command: str | None = None

    def __str__(self) -> str:
        if self.command is None:
            return f"plugin {self.entry_point!r} from {self.distribution} failed to load: {self.error}"
        return (f"command {self.command!r} of plugin {self.entry_point!r} from {self.distribution} failed to "
                f"load: {self.error}; block the plugin with {DISABLE_ENV}={self.entry_point}")


@attrs.define
class Registry:
    """All components, by stage and name, plus the plugins that failed to load."""

    components: dict[tuple[str, str], Component] = attrs.field(factory=dict)
    failures: list[PluginFailure] = attrs.field(factory=list)
    #: plugin distribution -> version, for the run directory's versions file
    distributions: dict[str, str] = attrs.field(factory=dict)

    def get(self, stage: str, name: str) -> Component:
        try:
            return self.components[(stage, name)]
        except KeyError:
            names = self.names(stage)
            hint = did_you_mean(name, names)
            choices = ", ".join(names) or "none installed"
            if not hint:  # not a typo: most likely a component of a plugin not installed here
                choices += (f"; is the plugin that provides it installed? "
                            f"(octfw list --stage {stage})")
            raise PluginError(f"unknown {stage} component {name!r}{hint}; available: {choices}") from None

    def names(self, stage: str) -> list[str]:
        return sorted(n for (s, n) in self.components if s == stage)

    def by_stage(self, stage: str | None = None) -> list[Component]:
        items = [c for c in self.components.values() if stage is None or c.stage == stage]
        order = list(hookspecs.STAGES)
        return sorted(items, key=lambda c: (order.index(c.stage), c.name))

    def add(self, component: Component) -> None:
        key = (component.stage, component.name)
        existing = self.components.get(key)
        if existing is not None:
            raise PluginError(
                f"{component.stage} component {component.name!r} is registered twice: "
                f"by {existing.plugin} ({existing.distribution} {existing.version}) and by "
                f"{component.plugin} ({component.distribution} {component.version}); "
                f"uninstall one or block it with {DISABLE_ENV}"
            )
        self.components[key] = component


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _disabled_plugins() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {item.strip() for item in raw.split(",") if item.strip()}


def _octfw_version() -> str:
    from octfw.version import __version__

    return __version__


def make_plugin_manager(
    builtins: Iterable[str] | None = None,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
) -> tuple[pluggy.PluginManager, list[PluginFailure], dict[str, tuple[str, str]]]:
    """A fresh plugin manager with built-in and third-party plugins loaded.

    ``builtins`` lists module names (default: :data:`BUILTIN_PLUGINS`);
    ``entry_points`` defaults to the installed ``octfw`` entry points.
    Returns the manager, the plugins that failed to load, and for each plugin
    name its (distribution, version).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs.OctfwSpecs)
    disabled = _disabled_plugins()
    for name in disabled:
        pm.set_blocked(name)
    origins: dict[str, tuple[str, str]] = {}
    failures: list[PluginFailure] = []

    for module_name in BUILTIN_PLUGINS if builtins is None else builtins:
        if module_name in disabled:
            continue
        pm.register(importlib.import_module(module_name), name=module_name)
        origins[module_name] = (BUILTIN_DISTRIBUTION, _octfw_version())

    if entry_points is None:
        entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in entry_points:
        dist = ep.dist.name if ep.dist is not None else "unknown distribution"
        version = ep.dist.version if ep.dist is not None else "?"
        if ep.name in disabled or dist in disabled or pm.is_registered(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
            # A hookimpl whose name matches no hook (a typo) is an error now,
            # not a component that silently never appears.
            pm.check_pending()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break octfw
            if pm.is_registered(ep.name):
                pm.unregister(name=ep.name)
            failures.append(PluginFailure(dist, ep.name, f"{type(exc).__name__}: {exc}"))
            continue
        origins[ep.name] = (dist, version)
    return pm, failures, origins


def load_registry(
    builtins: Iterable[str] | None = None,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
) -> Registry:
    """Build a plugin manager and collect every component it registers.

    A third-party plugin whose registration raises is reported as a failure
    and its components are dropped; a duplicate name is an error. The failures
    include those of the plugins' commands (:func:`load_commands`), so that
    ``octfw list`` and every command that loads the registry name them.
    """
    pm, failures, origins = make_plugin_manager(builtins, entry_points)
    registry = Registry(failures=failures)
    list(_commands(pm, origins, failures))  # for their failures: the commands themselves are the CLI's
    for plugin_name, (dist, version) in origins.items():
        if dist != BUILTIN_DISTRIBUTION:
            registry.distributions[dist] = version
    for stage, (hook_name, _table, _many) in hookspecs.STAGES.items():

        def component(origin, name, config, factory, summary, *, _stage=stage):
            if not attrs.has(config):
                raise TypeError(f"config for {_stage} {name!r} must be an attrs class")
            if "name" in attrs.fields_dict(config):  # `name` selects the component in a recipe
                raise TypeError(f"config for {_stage} {name!r} has a field 'name', the key that selects "
                                "the component in a recipe table; call the option something else")
            dist, version, plugin = origin
            return Component(_stage, name, config, factory, summary.strip(), dist, version, plugin)

        for registered in _registrations(pm, hook_name, origins, failures, component):
            for item in registered:
                registry.add(item)
    return registry


def _registrations(pm: pluggy.PluginManager, hook_name: str, origins: dict[str, tuple[str, str]],
                   failures: list[PluginFailure], make: Callable[..., Any]) -> Iterable[list[Any]]:
    """Call the registration hook ``hook_name`` of each plugin, in registration order, with a
    ``register`` callback, and yield per plugin what it registered: ``make((distribution,
    version, plugin), *args)`` for each call of ``register(*args)``, which raises for a call
    it refuses. A third-party plugin whose registration raises is a failure and yields
    nothing; a built-in one raises (that is octfw's bug)."""
    for impl in getattr(pm.hook, hook_name).get_hookimpls():  # registration order: built-ins first
        dist, version = origins.get(impl.plugin_name, ("unknown distribution", "?"))
        registered: list[Any] = []

        def register(*args: Any, _origin=(dist, version, impl.plugin_name), _out=registered, **kwargs: Any) -> None:
            _out.append(make(_origin, *args, **kwargs))

        try:
            impl.function(register=register)
        except Exception as exc:  # noqa: BLE001
            if dist == BUILTIN_DISTRIBUTION:
                raise
            failures.append(PluginFailure(dist, impl.plugin_name, f"{type(exc).__name__}: {exc}"))
            continue
        yield registered


# --- commands ------------------------------------------------------------------------------

#: What a command's name may be: what a shell passes as one word and argparse shows as given.
_COMMAND_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


@attrs.frozen
class Command:
    """A subcommand of ``octfw`` that a plugin registered (``octfw_register_commands``)."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int] | str  #: a callable or "module:function", imported to run
    summary: str
    distribution: str  #: the distribution that ships it ("octfw" for built-in plugins)
    version: str
    plugin: str  #: the plugin module (or entry-point name) that registered it

    @property
    def origin(self) -> str:
        return f"{self.plugin} ({self.distribution} {self.version})"

    def __call__(self, args: argparse.Namespace) -> int:
        """Run the command: what ``octfw NAME`` calls once its arguments are parsed."""
        run = self.run
        if isinstance(run, str):
            module_name, _, attr = run.partition(":")
            run = getattr(importlib.import_module(module_name), attr)
        return run(args)


def _command(origin: tuple[str, str, str], name: Any, add_arguments: Any, run: Any, summary: str) -> Command:
    """The :class:`Command` of one ``register(name, add_arguments, run, summary)`` call; a
    malformed one raises (its plugin's registration fails)."""
    if not isinstance(name, str) or not _COMMAND_NAME.fullmatch(name):
        raise TypeError(f"command name {name!r}: lower-case letters, digits and '-', starting with a letter")
    if not callable(add_arguments):
        raise TypeError(f"command {name!r}: add_arguments must be a callable taking the command's parser")
    if not (callable(run) or (isinstance(run, str) and ":" in run)):
        raise TypeError(f"command {name!r}: run must be a callable or a 'module:function' string")
    dist, version, plugin = origin
    return Command(name, add_arguments, run, summary.strip(), dist, version, plugin)


def _commands(pm: pluggy.PluginManager, origins: dict[str, tuple[str, str]],
              failures: list[PluginFailure]) -> Iterable[Command]:
    """Every command the plugins register, in registration order, less those that fail.

    A third-party command's ``add_arguments`` is tried on a parser of its own first: one that
    raises would leave a half-built subcommand in ``octfw``'s parser and stop every command
    (``octfw run`` and a job's workers too), so it is a failure of that command alone, which
    is left out. A built-in's is not tried: its failure is octfw's bug, raised where it runs."""
    for registered in _registrations(pm, hookspecs.COMMANDS_HOOK, origins, failures, _command):
        for item in registered:
            if item.distribution != BUILTIN_DISTRIBUTION:
                try:
                    item.add_arguments(argparse.ArgumentParser(prog=f"octfw {item.name}"))
                except Exception as exc:  # noqa: BLE001 - the fix is in that plugin; the rest works
                    failures.append(PluginFailure(item.distribution, item.plugin,
                                                  f"add_arguments raised {type(exc).__name__}: {exc}", item.name))
                    continue
            yield item


def load_commands(
    reserved: Iterable[str] = (),
    builtins: Iterable[str] | None = None,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
) -> tuple[list[Command], list[PluginFailure]]:
    """The commands plugins register, in registration order, and the plugins that failed to load.

    ``reserved`` are the names of octfw's own commands. A command named like one of them or
    like another plugin's command is a :class:`~octfw.display.errors.PluginError` naming both
    distributions. A third-party plugin that fails to import, registers a command with a
    malformed name or whose registration raises is a failure (its commands dropped); a
    third-party command whose ``add_arguments`` raises is a failure of that command alone
    (dropped, :attr:`PluginFailure.command` naming it). The caller decides when to report
    failures (the registry's commands report them already: :func:`load_registry` has them too).
    """
    pm, failures, origins = make_plugin_manager(builtins, entry_points)
    reserved = set(reserved)
    commands: dict[str, Command] = {}
    for item in _commands(pm, origins, failures):
        if item.name in reserved:
            raise PluginError(
                f"command {item.name!r} is registered twice: by octfw {_octfw_version()} (one of its own "
                f"commands) and by {item.origin}; uninstall {item.distribution} or block it with "
                f"{DISABLE_ENV}={item.plugin}"
            )
        existing = commands.get(item.name)
        if existing is not None:
            remedy = (f"uninstall {item.distribution} or block it with {DISABLE_ENV}={item.plugin}"
                      if existing.distribution == BUILTIN_DISTRIBUTION
                      else f"uninstall one or block it with {DISABLE_ENV}")
            raise PluginError(f"command {item.name!r} is registered twice: by {existing.origin} and by "
                              f"{item.origin}; {remedy}")
        commands[item.name] = item
    return list(commands.values()), failures
