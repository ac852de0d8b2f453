"""Meta-tests of the plugin contract: every hook is documented, implemented and exercised.

After datasette's ``test_plugin_hooks_have_tests``: adding a hook to
:class:`octfw.hookspecs.OctfwSpecs` fails here until it is documented, wired
to a stage (or is the commands hook), given a built-in implementation and
registered through below.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import sys
import types

import attrs
import pytest

from octfw import hookspecs
from octfw.hookspecs import COMMANDS_HOOK, STAGES, OctfwSpecs, hookimpl
from octfw.registry import BUILTIN_PLUGINS, DISABLE_ENV, load_commands, load_registry, make_plugin_manager

HOOKS = sorted(name for name, value in vars(OctfwSpecs).items()
               if hasattr(value, f"{hookspecs.PROJECT}_spec"))


def test_there_are_hooks_and_each_is_a_stage_or_the_commands_hook():
    assert HOOKS, "no hook specification found on OctfwSpecs"
    assert all(name.startswith("octfw_") for name in HOOKS)
    # load_registry calls the hooks listed in STAGES, load_commands the commands hook:
    # a hook missing from both is never called.
    assert sorted([*(hook for hook, _table, _many in STAGES.values()), COMMANDS_HOOK]) == HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_hot_path_and_return(hook):
    doc = getattr(OctfwSpecs, hook).__doc__ or ""
    assert re.search(r"^\s*Hot path: (yes|no)\b", doc, re.MULTILINE), f"{hook}: say 'Hot path: yes/no'"
    assert ":return:" in doc, f"{hook}: document what the hook returns (':return:')"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_builtin_implementation(hook, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    pm, failures, _ = make_plugin_manager(entry_points=[])
    assert failures == []
    implementers = {impl.plugin_name for impl in getattr(pm.hook, hook).get_hookimpls()}
    assert implementers & set(BUILTIN_PLUGINS), f"no built-in plugin implements {hook}"


@attrs.frozen
class ProbeConfig:
    size: int = 1


def test_every_hook_registers_a_component_under_its_stage(monkeypatch):
    class Probe:
        """A third-party plugin with one component per hook, named after the stage it belongs in."""

        @hookimpl
        def octfw_register_datasets(self, register):
            register("probe-dataset", ProbeConfig, "math:sqrt", "dataset probe")

        @hookimpl
        def octfw_register_transforms(self, register):
            register("probe-transform", ProbeConfig, "math:sqrt", "transform probe")

        @hookimpl
        def octfw_register_models(self, register):
            register("probe-model", ProbeConfig, "math:sqrt", "model probe")

        @hookimpl
        def octfw_register_schedulers(self, register):
            register("probe-scheduler", ProbeConfig, "math:sqrt", "scheduler probe")

        @hookimpl
        def octfw_register_guards(self, register):
            register("probe-guard", ProbeConfig, "math:sqrt", "guard probe")

        @hookimpl
        def octfw_register_loggers(self, register):
            register("probe-logger", ProbeConfig, "math:sqrt", "logger probe")

        @hookimpl
        def octfw_register_checkpointers(self, register):
            register("probe-checkpointer", ProbeConfig, "math:sqrt", "checkpointer probe")

        @hookimpl
        def octfw_register_evaluators(self, register):
            register("probe-evaluator", ProbeConfig, "math:sqrt", "evaluator probe")

        @hookimpl
        def octfw_register_commands(self, register):
            register("probe-command", lambda parser: None, "math:sqrt", "command probe")

    implemented = sorted(name for name in vars(Probe) if name.startswith("octfw_"))
    assert implemented == HOOKS, "the probe plugin must register through every hook"

    module = types.ModuleType("plug_probe")
    module.plugin = Probe()
    monkeypatch.setitem(sys.modules, "plug_probe", module)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    entry_point = metadata.EntryPoint(name="plug_probe", value="plug_probe:plugin", group="octfw")

    registry = load_registry(builtins=[], entry_points=[entry_point])
    assert registry.failures == []
    for stage in STAGES:
        assert registry.names(stage) == [f"probe-{stage}"]  # under its own stage, and only there
        component = registry.get(stage, f"probe-{stage}")
        assert (component.stage, component.plugin, component.config) == (stage, "plug_probe", ProbeConfig)
        assert component.summary == f"{stage} probe"
    [command], failures = load_commands(builtins=[], entry_points=[entry_point])
    assert failures == []
    assert (command.name, command.plugin, command.summary) == ("probe-command", "plug_probe", "command probe")


def test_every_built_in_registration_hook_types_its_register_callback():
    """Plugin authors copy the built-ins: each shows the typed contract, as the hookspecs declare it."""
    import importlib
    import typing

    declared = {hook: typing.get_type_hints(getattr(OctfwSpecs, hook))["register"] for hook in HOOKS}
    assert declared[COMMANDS_HOOK] is hookspecs.RegisterCommand
    assert {declared[hook] for hook, _table, _many in STAGES.values()} == {hookspecs.Register}

    for module_name in BUILTIN_PLUGINS:
        module = importlib.import_module(module_name)
        hooks = [getattr(module, name) for name in dir(module) if name.startswith("octfw_register_")]
        assert hooks, module_name
        for hook in hooks:
            hints = typing.get_type_hints(hook)
            assert hints.get("register") is declared[hook.__name__], f"{module_name}.{hook.__name__}"
            assert hints.get("return") is type(None), f"{module_name}.{hook.__name__}"


def test_every_option_of_every_built_in_shows_its_doc_text_in_octfw_list(capsys):
    """What `octfw list --stage S --name N` prints is all a user reads: no option goes unexplained."""
    from octfw.cli.main import main

    undocumented, options = [], 0
    for component in load_registry(entry_points=[]).by_stage():
        assert main(["list", "--stage", component.stage, "--name", component.name, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        options += len(shown["options"])
        undocumented += [f"{component.stage} {component.name}: {row['key']}"
                         for row in shown["options"] if len(row["doc"].strip()) < 10]
    assert options > 100  # every component's options were read, nested tables (mask.ratio) included
    assert not undocumented, "options without doc() text:\n" + "\n".join(undocumented)
