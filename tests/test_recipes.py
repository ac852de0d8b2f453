"""Recipe loading: every bad recipe gets the message a user should see."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from octfw.recipe.config import EngineConfig
from octfw.display.errors import RecipeError, UserError
from octfw.recipe import load_recipe, parse_override, to_toml

from conftest import TINY_RECIPE

REPO = Path(__file__).resolve().parents[1]


def replace(old: str, new: str) -> str:
    assert old in TINY_RECIPE, old
    return TINY_RECIPE.replace(old, new, 1)


# (id, recipe text, --set overrides, expected fragment of the message)
BAD_RECIPES = [
    ("misspelled engine key", replace("base_lr = 1e-3", "base_lrr = 1e-3"), [],
     "engine.base_lrr: unknown key (did you mean 'base_lr'?)"),
    ("misspelled table", TINY_RECIPE + "\n[sheduler]\nname = 'constant'\n", [],
     "sheduler: unknown table (did you mean 'scheduler'?)"),
    ("misspelled component", replace('name = "vjepa3d"', 'name = "vjepa-3d"'), [],
     "model.name: unknown model component 'vjepa-3d' (did you mean 'vjepa3d'?)"),
    ("misspelled component option", replace('preset = "tiny"', 'presett = "tiny"'), [],
     "model.presett: unknown key (did you mean 'preset'?)"),
    ("string where a number belongs", replace("base_lr = 1e-3", 'base_lr = "fast"'), [],
     "engine.base_lr: expected a number, got the string 'fast'"),
    ("negative learning rate", replace("base_lr = 1e-3", "base_lr = -1e-3"), [],
     "engine.base_lr: must be > 0, got -0.001"),
    ("zero batch", replace("per_device_batch = 2", "per_device_batch = 0"), [],
     "engine.per_device_batch: must be > 0, got 0"),
    ("float where an integer belongs", replace("grad_accum_steps = 1", "grad_accum_steps = 1.5"), [],
     "engine.grad_accum_steps: expected an integer, got float 1.5"),
    ("boolean where an integer belongs", replace("max_steps = 4", "max_steps = true"), [],
     "run.max_steps: expected an integer, got a boolean (true)"),
    ("unknown device", replace('device = "cpu"', 'device = "tpu"'), [],
     "run.device: must be one of 'auto', 'cpu', 'cuda', 'xla', got 'tpu'"),
    ("neither steps nor epochs", replace("max_steps = 4\n", ""), [],
     "run: set run.max_steps or run.epochs (or both)"),
    ("image size of two values", replace("image_size = [8, 32, 32]", "image_size = [32, 32]"), [],
     "transform.image_size: expected an array of 3 values, got 2: [32, 32]"),
    ("missing dataset table", TINY_RECIPE.replace('[dataset]\nname = "synthetic-oct"\nn_volumes = 8\n', ""), [],
     "[dataset]: missing; choose a dataset component: dicom, oct-vendor, phantom-oct, prepared, synthetic-oct"),
    ("stage without a name", replace('[scheduler]\nname = "cosine-no-restart"', "[scheduler]"), [],
     "scheduler.name: required; choose a scheduler component: constant, cosine-no-restart"),
    ("component name not a string", replace('name = "vjepa3d"', "name = 3"), [],
     "model.name: expected a component name, got int 3"),
    ("null-like checkpoint dir", TINY_RECIPE + '\n[checkpointer]\nname = "local"\ndir = "None"\n', [],
     "checkpointer.dir: 'None' is not a location; leave the key out to use the default"),
    ("null checkpoint dir from --set", TINY_RECIPE, ["checkpointer.dir=null"],
     "--set checkpointer.dir=null: 'null' is not a location"),
    ("bucket named None", TINY_RECIPE, ["checkpointer.name=gcs", "checkpointer.dir=gs://None/ckpt"],
     "--set checkpointer.dir=gs://None/ckpt: 'gs://None/ckpt' names no bucket or host ('None')"),
    ("guard listed twice", TINY_RECIPE + '\n[[guard]]\nname = "nan-skip"\n[[guard]]\nname = "nan-skip"\n', [],
     "guard: component 'nan-skip' is listed more than once"),
    ("unknown guard option", TINY_RECIPE + '\n[[guard]]\nname = "grad-clip"\nmax_nrom = 1.0\n', [],
     "guard[0].max_nrom: unknown key (did you mean 'max_norm'?)"),
    ("guard given as a string", 'guard = "nan-skip"\n' + TINY_RECIPE, [],
     "guard: expected an array of tables [[guard]], got the string 'nan-skip'"),
    ("betas out of range", replace("base_lr = 1e-3", "base_lr = 1e-3\nbetas = [0.9, 1.5]"), [],
     "engine: engine.betas must each be in [0, 1), got [0.9, 1.5]"),
    ("mask ratio out of range", replace("image_size = [8, 32, 32]", "image_size = [8, 32, 32]\nmask = { ratio = 1.5 }"), [],
     "transform.mask.ratio"),
    ("wrong mask generator", replace("image_size = [8, 32, 32]", "image_size = [8, 32, 32]\nmask = { generator = \"blocks\" }"), [],
     "transform.mask.generator"),
    ("unknown preset", replace('preset = "tiny"', 'preset = "huge"'), [],
     "model.preset"),
    ("misspelled --set key", TINY_RECIPE, ["engine.lerning_rate=1e-4"],
     "--set engine.lerning_rate=1e-4: unknown key"),
    ("several problems at once", replace("base_lr = 1e-3", "base_lr = -1\nlog_every = 3"), [],
     "2 problems"),
]


@pytest.mark.parametrize("text, overrides, expected", [b[1:] for b in BAD_RECIPES],
                         ids=[b[0] for b in BAD_RECIPES])
def test_bad_recipe_names_the_key_and_what_was_expected(write_recipe, registry, text, overrides, expected):
    path = write_recipe(text)
    with pytest.raises(UserError) as exc:
        load_recipe(path, overrides, registry)
    assert expected in str(exc.value)
    assert str(path) in str(exc.value) or isinstance(exc.value, UserError)


def test_every_problem_is_reported_at_once(write_recipe, registry):
    text = replace("base_lr = 1e-3", "base_lr = -1\nlog_every = 3").replace('preset = "tiny"', 'preset = 3')
    with pytest.raises(RecipeError) as exc:
        load_recipe(write_recipe(text), (), registry)
    keys = [p.split(":")[0] for p in exc.value.problems]
    assert sorted(keys) == ["engine.base_lr", "engine.log_every", "model.preset"]


def test_a_problem_in_a_set_value_names_the_set_option_not_the_file(write_recipe, registry):
    path = write_recipe(TINY_RECIPE + '[[guard]]\nname = "nan-skip"\n[[guard]]\nname = "grad-clip"\n')
    with pytest.raises(RecipeError) as exc:
        load_recipe(path, ["engine.bse_lr=1e-4", "engine.base_lr=1e-3", "guard.1.max_norm=x",
                           "transform.mask={ ratio = 2.0 }", "engine.log_every_steps=0"], registry)
    assert sorted(exc.value.problems) == [
        "--set engine.bse_lr=1e-4: unknown key (did you mean 'base_lr'?); valid keys: " + ", ".join(
            attrs.fields_dict(EngineConfig)),
        "--set engine.log_every_steps=0: must be > 0, got 0",
        "--set guard.1.max_norm=x: expected a number, got the string 'x'",
        "--set transform.mask={ ratio = 2.0 }: transform.mask.ratio: must be in (0.0, 1.0), got 2.0",
    ]
    with pytest.raises(RecipeError) as exc:  # the file's own mistake still names its key
        load_recipe(write_recipe(TINY_RECIPE.replace("max_steps = 4", "max_steps = 0")),
                    ["engine.base_lr=1e-3"], registry)
    assert exc.value.problems == ["run.max_steps: must be > 0, got 0"]


def test_invalid_toml_names_file_and_line(write_recipe, registry):
    path = write_recipe("[run\nseed = 1\n")
    with pytest.raises(UserError, match=r"recipe.toml: not valid TOML: .*line 1"):
        load_recipe(path, (), registry)


def test_missing_recipe_file(tmp_path, registry):
    with pytest.raises(UserError, match="nope.toml: recipe not found"):
        load_recipe(tmp_path / "nope.toml", (), registry)


def test_extends_inherits_and_child_wins(write_recipe, registry):
    write_recipe(TINY_RECIPE, "base.toml")
    child = write_recipe('extends = "base.toml"\n[engine]\nbase_lr = 2e-3\n', "child.toml")
    recipe = load_recipe(child, (), registry)
    assert recipe.engine.base_lr == 2e-3
    assert recipe.engine.per_device_batch == 2  # inherited
    assert recipe.name == "child"


def test_extends_with_another_component_drops_the_parents_options(write_recipe, registry):
    write_recipe(TINY_RECIPE, "base.toml")
    child = write_recipe('extends = "base.toml"\n[scheduler]\nname = "constant"\n', "child.toml")
    assert load_recipe(child, (), registry).scheduler.name == "constant"


GUARDED = TINY_RECIPE + '\n[[guard]]\nname = "nan-skip"\n\n[[guard]]\nname = "grad-clip"\nmax_norm = 1.0\n'


def test_extends_replaces_an_array_of_tables_unless_the_child_appends(write_recipe, registry):
    write_recipe(GUARDED, "base.toml")
    replaced = write_recipe('extends = "base.toml"\n[[guard]]\nname = "lr-positive"\n', "replaced.toml")
    assert [g.name for g in load_recipe(replaced, (), registry).guards] == ["lr-positive"]

    appended = write_recipe('extends = "base.toml"\nappend = ["guard"]\n[[guard]]\nname = "lr-positive"\n'
                            '[[guard]]\nname = "grad-clip"\nmax_norm = 0.5\n', "appended.toml")
    guards = load_recipe(appended, (), registry).guards
    assert [g.name for g in guards] == ["nan-skip", "grad-clip", "lr-positive"]
    assert guards[1].config.max_norm == 0.5  # the child's options for a guard the parent lists


def test_append_mistakes_name_the_file_and_the_array(write_recipe, registry):
    write_recipe(GUARDED, "base.toml")
    nothing = write_recipe('extends = "base.toml"\nappend = ["logger"]\n', "nothing.toml")
    with pytest.raises(UserError, match=r"append = \['logger'\]: this file has no \[\[logger\]\] tables"):
        load_recipe(nothing, (), registry)
    alone = write_recipe(GUARDED.replace("[run]", 'append = ["guard"]\n[run]', 1), "alone.toml")
    with pytest.raises(UserError, match="only a recipe that extends another can append"):
        load_recipe(alone, (), registry)


def test_extends_cycle_is_refused(write_recipe, registry):
    write_recipe('extends = "b.toml"\n', "a.toml")
    b = write_recipe('extends = "a.toml"\n', "b.toml")
    with pytest.raises(UserError, match="extend each other in a cycle"):
        load_recipe(b, (), registry)


def test_extends_missing_parent(write_recipe, registry):
    path = write_recipe('extends = "gone.toml"\n' + TINY_RECIPE)
    with pytest.raises(UserError, match="extends: 'gone.toml' not found"):
        load_recipe(path, (), registry)


def test_set_overrides_values_with_toml_types(tiny_recipe, registry):
    recipe = load_recipe(tiny_recipe, ["engine.base_lr=5e-4", "transform.image_size=[16, 32, 32]",
                                       "run.device=xla", "guard.0.max_consecutive_skips=3"], registry)
    assert recipe.engine.base_lr == 5e-4
    assert recipe.transform.config.image_size == (16, 32, 32)
    assert recipe.run.device == "xla"
    assert recipe.guards[0].config.max_consecutive_skips == 3


def test_set_without_equals_is_refused():
    with pytest.raises(UserError, match="expected table.key=value"):
        parse_override("engine.base_lr")


def test_missing_keys_take_documented_defaults_never_the_string_none(tiny_recipe, registry):
    recipe = load_recipe(tiny_recipe, (), registry)
    assert recipe.checkpointer.config.dir is None
    assert recipe.run.cache_dir is None
    assert [g.name for g in recipe.guards] == ["nan-skip"]
    assert "None" not in to_toml(recipe.to_dict())


def test_relative_paths_resolve_against_the_recipe_folder(write_recipe, registry, tmp_path, monkeypatch):
    sub = tmp_path / "recipes"
    sub.mkdir()
    (sub / "r.toml").write_text(TINY_RECIPE + '\n[checkpointer]\nname = "local"\ndir = "../ckpt"\n')
    monkeypatch.chdir("/")
    recipe = load_recipe(sub / "r.toml", ["run.output_dir=out"], registry)
    assert recipe.checkpointer.config.dir == str(tmp_path / "ckpt")
    assert recipe.run.output_dir == "/out"  # --set values are relative to the current folder
    assert load_recipe(sub / "r.toml", ["checkpointer.dir=gs://bucket/x"], registry).checkpointer.config.dir == "gs://bucket/x"


def test_show_output_loads_back_to_the_same_recipe(tiny_recipe, registry, tmp_path):
    recipe = load_recipe(tiny_recipe, (), registry)
    again = tmp_path / "again.toml"
    again.write_text(to_toml(recipe.to_dict()))
    assert load_recipe(again, (), registry).to_dict() == recipe.to_dict()


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "recipes").glob("*.toml")))
def test_shipped_recipes_validate(name, registry):
    recipe = load_recipe(REPO / "recipes" / f"{name}.toml", (), registry)
    assert recipe.model.name == ("mae3d" if name.startswith("mae") else "vjepa3d")


def test_multi_domain_recipe_carries_the_seeds_numbers(registry):
    recipe = load_recipe(REPO / "recipes" / "multi_domain.toml", (), registry)
    assert recipe.transform.config.image_size == (64, 384, 384)
    assert recipe.model.config.patch_size == (4, 16, 16)
    assert recipe.transform.config.mask.ratio == 0.6
    assert (recipe.engine.per_device_batch, recipe.engine.global_batch) == (1, 32)
    from octfw.engine.distributed import layout_for

    v4_32 = layout_for(1, recipe.engine.grad_accum_steps, recipe.engine.global_batch, processes=4, devices_per_process=4)
    assert v4_32.grad_accum_steps == 2  # 1 per device x 16 devices x 2 accumulation steps
    assert (recipe.engine.base_lr, recipe.engine.weight_decay, recipe.engine.betas) == (1e-4, 0.05, (0.9, 0.95))
    assert recipe.run.epochs == 150 and recipe.scheduler.config.ema_start == 0.996
    assert [g.config.max_norm for g in recipe.guards if g.name == "grad-clip"] == [0.01]


#: Values for the options a built-in component requires; every other option keeps its default.
REQUIRED = {
    ("dataset", "dicom"): {"path": "cohort/manifest.csv"},
    ("dataset", "oct-vendor"): {"path": "vendor-files"},
    ("dataset", "prepared"): {"path": "prepared-store"},
    ("checkpointer", "gcs"): {"dir": "gs://bucket/run"},
    **{("evaluator", name): {"dataset": {"name": "synthetic-oct", "labels": True}}
       for name in ("attentive-probe", "fine-tune", "knn", "linear-probe")},
    ("evaluator", "dense-probe"): {"dataset": {"name": "phantom-oct", "family": "held-out"}},
    ("evaluator", "layer-segmentation"): {"dataset": {"name": "synthetic-oct"}},
}


def test_every_built_in_component_survives_the_saved_recipe_round_trip(registry):
    """What a run saves (the resolved table, every option filled in) loads back to the same config:
    no option is lost or renamed on the way (the W&B logger's display name once was)."""
    import tomllib

    from octfw.recipe import structure_stage

    seen = 0
    for component in registry.by_stage():
        if component.distribution != "octfw":
            continue
        table = {"name": component.name, **REQUIRED.get((component.stage, component.name), {})}
        spec, problems = structure_stage(registry, component.stage, table, component.stage)
        assert spec is not None and not problems, (component.name, problems)
        saved = tomllib.loads(to_toml({"table": spec.to_table()}))["table"]  # as recipe.toml is written
        assert saved["name"] == component.name
        again, problems = structure_stage(registry, component.stage, saved, component.stage)
        assert again is not None and not problems, (component.name, problems)
        assert again.config == spec.config, component.name
        seen += 1
    assert seen == len([c for c in registry.by_stage() if c.distribution == "octfw"]) >= 21


def _varied(value):
    """Values other than a field's default, of its kind, to try (a validator may refuse some)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, 1]
    if isinstance(value, float):
        return [value / 2, value * 2, 0.5] if value else [0.5, 1.0]
    if isinstance(value, str):
        return []  # a free string round-trips as itself; a choice is tried through _choices
    if isinstance(value, tuple) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value):
        return [tuple(type(v)(v * 2) for v in value), tuple(type(v)(v / 2) if isinstance(v, float) else v + 1
                                                            for v in value)]
    return []


def test_every_option_of_every_built_in_set_to_another_value_survives_the_saved_recipe_round_trip(registry):
    """Each option, set on its own to a value other than its default that validates, is written to
    a recipe.toml as a run saves it and read back unchanged, with every other option."""
    import tomllib

    import attrs

    from octfw.recipe import structure_stage

    varied = 0
    for component in registry.by_stage():
        if component.distribution != "octfw":
            continue
        base = {"name": component.name, **REQUIRED.get((component.stage, component.name), {})}
        for field in attrs.fields(component.config):
            if field.default is attrs.NOTHING or field.name in base:
                continue
            default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
            for value in _varied(default):
                spec, problems = structure_stage(registry, component.stage, {**base, field.name: value}, "t")
                if problems:
                    continue  # outside the field's range: try the next
                saved = tomllib.loads(to_toml({"table": spec.to_table()}))["table"]
                again, problems = structure_stage(registry, component.stage, saved, "t")
                assert not problems, (component.name, field.name, problems)
                assert again.config == spec.config, (component.name, field.name)
                assert getattr(again.config, field.name) != default, (component.name, field.name)
                varied += 1
                break
    assert varied >= 60  # most numeric and boolean options of the built-ins
