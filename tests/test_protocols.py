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
    ("dataset", "octfw.plugins.datasets.dicom.dataset", "DicomDataset"),
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
    from octfw.plugins.datasets.dicom.dataset import DicomDataset
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
    """stage -> (required protocol, its members, {optional protocol: members}) from README's table."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("### What each stage's component has", 1)[1].split("\n#", 1)[0]
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
