"""Every capability is a declared protocol: each stage's built-ins satisfy theirs, a component
missing a required member is refused when it is built, and the plugin guide lists them all."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from octfw.hookspecs import STAGES
from octfw.registry import BUILTIN_DISTRIBUTION, load_registry
from octfw.types import (
    OPTIONAL_PROTOCOLS, STAGE_PROTOCOLS, ClaimingCheckpointer, CancellableCheckpointer, ComparingEvaluator,
    CountingModel, EMAModel, EmbeddingModel, EncoderModel, ExportableEncoder, LabelledDataset,
    ListingCheckpointer, LocatedCheckpointer, NamingDataset, ParamGroupsModel, PatientDataset, PreparingTransform,
    RefittingEvaluator, SourcedDataset, Stateful, StepListener, WarmupSchedule, missing_members, protocol_members,
)

from conftest import TINY_RECIPE, make_dist

REPO = Path(__file__).resolve().parents[1]


def test_every_stage_has_one_runtime_checkable_protocol_and_its_optional_ones():
    assert list(STAGE_PROTOCOLS) == list(STAGES) == list(OPTIONAL_PROTOCOLS)
    for stage, protocol in STAGE_PROTOCOLS.items():
        for declared in (protocol, *OPTIONAL_PROTOCOLS[stage]):
            assert getattr(declared, "_is_runtime_protocol", False), declared.__name__
            assert protocol_members(declared), declared.__name__


def test_every_built_in_factory_types_its_ctx_as_a_build_context():
    for component in load_registry(entry_points=[]).by_stage():
        assert component.distribution == BUILTIN_DISTRIBUTION
        ctx = inspect.signature(component.factory).parameters["ctx"].annotation
        assert ctx in ("BuildContext", "octfw.types.BuildContext"), f"{component.stage} {component.name}: {ctx!r}"


def test_missing_members_names_what_is_absent_and_what_is_not_callable():
    class HalfGuard:
        at_log_step = None  # present, but not a method

    assert missing_members(HalfGuard(), STAGE_PROTOCOLS["guard"]) == ["before_step", "at_log_step"]


# --- the built-ins --------------------------------------------------------------

ALL_BUILT_INS = TINY_RECIPE + """
[[guard]]
name = "nan-skip"

[[guard]]
name = "grad-clip"

[[guard]]
name = "lr-positive"

[[guard]]
name = "loss-spike"

[[guard]]
name = "collapse"

[[logger]]
name = "console"

[[logger]]
name = "tensorboard"

[[evaluator]]
name = "linear-probe"
dataset = { name = "synthetic-oct", n_volumes = 8, labels = true, seed = 5 }
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny recipe with every guard and the local loggers, built as ``octfw run`` builds it."""
    from octfw.engine.build import build_components
    from octfw.recipe import load_recipe

    folder = tmp_path_factory.mktemp("all-built-ins")
    path = folder / "recipe.toml"
    path.write_text(ALL_BUILT_INS)
    registry = load_registry(entry_points=[])
    recipe = load_recipe(path, (), registry)
    return build_components(recipe, registry, run_dir=folder / "run")


def test_each_built_component_satisfies_its_stages_protocol(built):
    for stage, protocol in STAGE_PROTOCOLS.items():
        value = built.by_stage[stage]
        for component in value if isinstance(value, list) else [value]:
            assert isinstance(component, protocol), (stage, type(component).__name__)
            assert missing_members(component, protocol) == []


def test_the_built_ins_declare_the_optional_capabilities_the_engine_uses(built):
    model = built.model
    for capability in (EMAModel, ParamGroupsModel, EmbeddingModel, EncoderModel, CountingModel):
        assert isinstance(model, capability), capability.__name__
    assert isinstance(model.encoder, ExportableEncoder)
    assert isinstance(built.dataset, SourcedDataset) and isinstance(built.dataset, NamingDataset)
    assert isinstance(built.transform, PreparingTransform)
    assert isinstance(built.scheduler, WarmupSchedule)
    for capability in (ListingCheckpointer, ClaimingCheckpointer, CancellableCheckpointer, LocatedCheckpointer):
        assert isinstance(built.checkpointer, capability), capability.__name__
    by_name = dict(zip(_specs(built, "guard"), built.guards))
    assert {name for name, guard in by_name.items() if isinstance(guard, Stateful)} == {
        "nan-skip", "loss-spike", "collapse"}
    assert [isinstance(logger, StepListener) for logger in built.loggers] == [False, True, False]
    [evaluator] = built.evaluators
    assert isinstance(evaluator, RefittingEvaluator) and isinstance(evaluator, ComparingEvaluator)


def _specs(built, stage):
    return [table["name"] for table in built.ctx.recipe[STAGES[stage][1]]]


@pytest.mark.parametrize("stage, module, name", [
    ("model", "octfw.plugins.models.mae3d.model", "MAE3D"),
    ("dataset", "octfw.dicom.dataset", "DicomDataset"),
    ("dataset", "octfw.plugins.datasets.vendor.reader", "VendorDataset"),
    ("dataset", "octfw.plugins.datasets.prepared.dataset", "PreparedDataset"),
    ("logger", "octfw.plugins.loggers.wandb", "WandbLogger"),
    ("checkpointer", "octfw.plugins.checkpointers.gcs", "GcsCheckpointer"),
    ("evaluator", "octfw.plugins.evaluators.attentive_probe.evaluator", "AttentiveProbeEvaluator"),
    ("evaluator", "octfw.plugins.evaluators.fine_tune.evaluator", "FineTuneEvaluator"),
])
def test_each_built_in_class_not_built_above_has_its_stages_methods(stage, module, name):
    """Built above: the tiny recipe's. These need files, a store or an account to build,
    so their classes are checked (attributes an instance sets in ``__init__`` aside)."""
    import importlib

    cls = getattr(importlib.import_module(module), name)
    instance_attributes = {"every_steps", "cache"}
    protocol = STAGE_PROTOCOLS[stage]
    data = set(protocol.__dict__.get("__annotations__", {}))  # attributes (Model.inputs), not methods
    missing = [m for m in protocol_members(protocol) if m not in instance_attributes
               and not (hasattr(cls, m) if m in data else callable(getattr(cls, m, None)))]
    assert missing == [], f"{name} lacks {missing}"


def test_the_labelled_datasets_say_labels_and_patients_without_decoding():
    from octfw.dicom.dataset import DicomDataset
    from octfw.plugins.datasets.prepared.dataset import PreparedDataset

    for cls in (DicomDataset, PreparedDataset):
        assert all(callable(getattr(cls, m, None)) for m in ("label", "patient")), cls.__name__
    assert {LabelledDataset, PatientDataset} <= set(OPTIONAL_PROTOCOLS["dataset"])


# --- a third-party component without a required member --------------------------

HALF_GUARD = '''
import attrs
from octfw.hookspecs import Register, hookimpl


@attrs.frozen
class WatchConfig:
    pass


class Watch:  # only watches at log steps: forgot that every guard has before_step
    def at_log_step(self, update_step, metrics):
        pass


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register("watch", WatchConfig, lambda config, ctx: Watch(), "watches the loss")
'''

HALF_MODEL = '''
import attrs
from octfw.hookspecs import Register, hookimpl


@attrs.frozen
class BareConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)


class Bare:  # a forward and nothing else: not a torch.nn.Module
    def forward(self, batch):
        raise AssertionError("never called: refused at build")

    __call__ = forward


@hookimpl
def octfw_register_models(register: Register) -> None:
    register("bare", BareConfig, lambda config, ctx: Bare(), "a model without parameters")
'''


def _octfw_run(tmp_path: Path, dist: str, module: str, code: str, recipe_text: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, dist, module, code, version="0.4.1")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe_text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "octfw.cli", "run", str(recipe)], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)


def test_a_plugin_guard_without_before_step_is_refused_before_training_in_one_line(tmp_path):
    done = _octfw_run(tmp_path, "acme-guards", "acme_guards", HALF_GUARD,
                      TINY_RECIPE + '\n[[guard]]\nname = "watch"\n')
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("octfw: error:")]
    assert errors == [
        "octfw: error: guard 'watch' from acme-guards 0.4.1 lacks before_step, which every guard must have "
        "(octfw.types.Guard: before_step, at_log_step; built a Watch); see 'Writing a plugin' in octfw's README"
    ], done.stderr
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / "runs").glob("*/*/metrics.jsonl"))  # not one step trained


def test_a_plugin_model_that_is_no_module_is_refused_naming_every_missing_method(tmp_path):
    recipe = re.sub(r'\[model\]\n(.*\n)*?\n', '[model]\nname = "bare"\n\n', TINY_RECIPE, count=1)
    done = _octfw_run(tmp_path, "acme-models", "acme_models", HALF_MODEL, recipe)
    assert done.returncode == 2, done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("octfw: error:")]
    assert error.startswith("octfw: error: model 'bare' from acme-models 0.4.1 lacks inputs, parameters, modules, "
                            "state_dict, load_state_dict, to, train, eval, which every model must have "
                            "(octfw.types.Model: "), done.stderr
    assert "Traceback" not in done.stderr


# --- the plugin guide -------------------------------------------------------------


def _guide_table() -> dict[str, tuple[str, list[str], dict[str, list[str]]]]:
    """stage -> (required protocol, its members, {optional protocol: members}) from the plugin guide's table."""
    text = (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = text.split("## What each stage's component has", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("Stage", "") or set(cells[0]) <= set("-: "):
            continue
        stage, required, optional = cells

        def groups(cell: str) -> dict[str, list[str]]:
            found = re.findall(r"`(\w+)`: ((?:`[\w_]+`(?:, )?)+)", cell)
            return {name: re.findall(r"`([\w_]+)`", members) for name, members in found}

        [(protocol, members)] = groups(required).items()
        rows[stage] = (protocol, members, groups(optional))
    return rows


def test_the_plugin_guide_lists_each_stages_required_and_optional_members_as_declared():
    table = _guide_table()
    assert list(table) == list(STAGES)
    for stage, (protocol, members, optional) in table.items():
        declared = STAGE_PROTOCOLS[stage]
        assert (protocol, members) == (declared.__name__, list(protocol_members(declared))), stage
        assert optional == {p.__name__: list(protocol_members(p, inherited=False))
                            for p in OPTIONAL_PROTOCOLS[stage]}, stage


# --- the same capabilities on every Python: 3.12's lookup ---------------------------
#
# Python 3.12 made isinstance() against a runtime_checkable protocol look members up with
# inspect.getattr_static, which never calls __getattr__, where a torch.nn.Module keeps its
# submodules, parameters and buffers. octfw's protocols keep the lookup of 3.10 and 3.11
# (getattr) on every Python (octfw.types._CapabilityMeta). These tests run 3.12's lookup: on
# 3.10 and 3.11 emulated (typing's check replaced by a port of CPython 3.12's), on 3.12 and
# later the Python's own; and compare with 3.11's rule, ported too so that 3.12 can run it.

import abc
import contextlib
import typing

import octfw.types as octfw_types

_TYPING_CHECK = type(typing.Protocol).__instancecheck__  # typing's own, as imported (not octfw's)
RUNTIME_PROTOCOLS = [value for value in vars(octfw_types).values()
                     if isinstance(value, type) and value is not typing.Protocol
                     and getattr(value, "_is_protocol", False) and getattr(value, "_is_runtime_protocol", False)]


def _typing_members(protocol: type) -> set[str]:
    """The members typing's isinstance asks for: computed per call up to 3.11, cached on the class after."""
    return set(getattr(protocol, "__protocol_attrs__", None) or typing._get_protocol_attrs(protocol))


def _as_python_311(instance, protocol: type) -> bool:
    """isinstance(instance, protocol) as CPython 3.10 and 3.11 answer it (typing's
    _ProtocolMeta.__instancecheck__, runtime protocols only): each member found by getattr."""
    members = _typing_members(protocol)
    if all(callable(getattr(protocol, m, None)) for m in members) and issubclass(type(instance), protocol):
        return True
    if all(hasattr(instance, m) and (not callable(getattr(protocol, m, None)) or getattr(instance, m) is not None)
           for m in members):
        return True
    return abc.ABCMeta.__instancecheck__(protocol, instance)


def _as_python_312(cls, instance) -> bool:
    """CPython 3.12's _ProtocolMeta.__instancecheck__ (3.12.1's typing.py), on any Python:
    a nominal (ABC) check, else each member found by inspect.getattr_static."""
    if cls is typing.Protocol or not getattr(cls, "_is_protocol", False) \
            or not getattr(cls, "_is_runtime_protocol", False):
        return _TYPING_CHECK(cls, instance)  # no lookup of members: the same on every Python
    if abc.ABCMeta.__instancecheck__(cls, instance):
        return True
    for attr in _typing_members(cls):
        try:
            value = inspect.getattr_static(instance, attr)
        except AttributeError:
            return False
        if value is None and callable(getattr(cls, attr, None)):
            return False
    return True


@contextlib.contextmanager
def _lookup_as_python_312():
    """isinstance against any protocol looks members up as Python 3.12 does: emulated before
    3.12, the Python's own from 3.12 on (nothing replaced: the check is for real)."""
    if sys.version_info >= (3, 12):
        yield
        return
    meta = type(typing.Protocol)
    meta.__instancecheck__ = _as_python_312
    try:
        yield
    finally:
        meta.__instancecheck__ = _TYPING_CHECK


def _build(folder: Path, text: str):
    from octfw.engine.build import build_components
    from octfw.recipe import load_recipe

    folder.mkdir()
    path = folder / "recipe.toml"
    path.write_text(text)
    registry = load_registry(entry_points=[])
    recipe = load_recipe(path, (), registry)
    return recipe, build_components(recipe, registry, run_dir=folder / "run")


MAE3D_RECIPE = TINY_RECIPE.replace('name = "vjepa3d"', 'name = "mae3d"').replace(
    'image_size = [8, 32, 32]', 'image_size = [8, 32, 32]\nmask = { generator = "random", ratio = 0.75 }')
LABELLED = '{ name = "synthetic-oct", n_volumes = 8, labels = true, seed = 5 }'
EVERY_EVALUATOR = f"""
[[evaluator]]
name = "knn"
dataset = {LABELLED}
k = 3

[[evaluator]]
name = "attentive-probe"
dataset = {LABELLED}

[[evaluator]]
name = "fine-tune"
dataset = {LABELLED}

[[evaluator]]
name = "dense-probe"
dataset = {{ name = "phantom-oct", family = "tuning", n_volumes = 8, seed = 1 }}
"""


@pytest.fixture(scope="module")
def every_built_in(built, tmp_path_factory):
    """(name, component) for each built-in that builds without files, a store or an account
    (dicom, oct-vendor and prepared need files, wandb an account, gcs a store: none is a
    torch.nn.Module), both models at the tiny preset with their encoders and submodules, and
    the config each stage's protocols read (a dataset's config class, the transform's config)."""
    folder = tmp_path_factory.mktemp("every-built-in")
    recipe, mae = _build(folder / "mae3d", MAE3D_RECIPE.replace('"cosine-no-restart"\nwarmup = 1', '"constant"')
                 + EVERY_EVALUATOR)
    assert [type(m).__name__ for m in (built.model, mae.model)] == ["VJEPA3D", "MAE3D"]
    assert {c.name for c in load_registry(entry_points=[]).by_stage("model")} == {"vjepa3d", "mae3d"}
    found = []
    for parts in (built, mae):
        for stage, value in parts.by_stage.items():
            for component in value if isinstance(value, list) else [value]:
                found.append((f"{stage} {type(component).__name__}", component))
        model = parts.model
        found.append((f"{type(model).__name__}.encoder", model.encoder))
        found += [(f"{type(model).__name__}.{name}", module) for name, module in model.named_modules() if name]
    found += [(f"config {type(spec.config).__name__}", spec.config) for spec in recipe.stages()]
    found += [(f"{c.stage} config {c.config.__name__}", c.config) for c in load_registry(entry_points=[]).by_stage()]
    return found


def test_the_ported_lookups_are_the_pythons_own(every_built_in):
    """The ports above answer as this Python's typing does (3.11's on 3.10 and 3.11, 3.12's from 3.12)."""
    port = _as_python_311 if sys.version_info < (3, 12) else (lambda obj, p: _as_python_312(p, obj))
    for name, component in every_built_in:
        for protocol in RUNTIME_PROTOCOLS:
            assert port(component, protocol) == _TYPING_CHECK(protocol, component), (name, protocol.__name__)


def test_protocol_members_are_the_members_typing_checks():
    for protocol in RUNTIME_PROTOCOLS:
        assert set(protocol_members(protocol)) == _typing_members(protocol), protocol.__name__
        assert type(protocol) is octfw_types._CapabilityMeta, protocol.__name__


def test_every_built_in_has_the_same_capabilities_under_python_312s_lookup(every_built_in):
    differ = []
    with _lookup_as_python_312():
        for name, component in every_built_in:
            for protocol in RUNTIME_PROTOCOLS:
                if isinstance(component, protocol) != _as_python_311(component, protocol):
                    differ.append(f"{name}: {protocol.__name__}")
        mae = next(c for name, c in every_built_in if name == "model MAE3D")
        exported = isinstance(mae, EncoderModel) and isinstance(mae.encoder, ExportableEncoder)
    assert differ == []
    assert exported  # mae3d's encoder, a submodule: RUN/encoder, octfw export, the fine-tune evaluators


@typing.runtime_checkable
class _HasWeight(typing.Protocol, metaclass=type(EncoderModel)):  # as octfw declares its own
    weight: typing.Any  # a parameter of torch.nn.Linear


@typing.runtime_checkable
class _HasSteps(typing.Protocol, metaclass=type(EncoderModel)):
    steps: typing.Any  # a buffer


def test_a_submodule_parameter_or_buffer_is_a_member_under_python_312s_lookup():
    import torch

    class Net(torch.nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.encoder = torch.nn.Linear(2, 2)
            self.register_buffer("steps", torch.zeros(1))

    with _lookup_as_python_312():
        for protocol in (EncoderModel, _HasWeight, _HasSteps):
            assert isinstance(Net(), protocol), protocol.__name__
            assert not isinstance(torch.nn.Module(), protocol), protocol.__name__


def test_an_mae3d_run_exports_its_encoder_under_python_312s_lookup(tmp_path):
    import octfw

    path = tmp_path / "mae3d.toml"
    path.write_text(MAE3D_RECIPE)
    with _lookup_as_python_312():
        result = octfw.train(octfw.load_recipe(path, ["run.max_steps=1", f"run.output_dir={tmp_path / 'runs'}"]))
    assert result.summary["update_steps"] == 1 and result.summary["stopped"] is None
    assert (result.run_dir / "encoder").is_dir()
