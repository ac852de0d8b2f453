"""``model.predictor_warmup_steps``: the encoder held (learning rate 0, its EMA copy unchanged)
while a new predictor trains, on by default where ``init`` leaves the predictor new; a function
of the update step, so a resumed run holds until the same step."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from octfw.engine.optim import HELD_UNTIL, apply_schedule, held_momentum
from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build
from octfw.plugins.models.vjepa3d.config import PREDICTOR_WARMUP_STEPS
from octfw.types import BuildContext

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "tests" / "fixtures" / "reference" / "vjepa2" / "checkpoint.pt"
#: The tiny recipe (tests/conftest.py) at the sizes of the V-JEPA 2 fixture's network, started from it.
FROM_FIXTURE = ['model.init="weights.pt"', 'model.position="rope"', "model.norm_eps=1e-6",
                "model.patch_size=[2,16,16]", "model.embed_dim=48", "model.depth=2", "model.num_heads=3",
                "model.predictor_embed_dim=32", "model.predictor_depth=2", "model.predictor_num_heads=2",
                "engine.checkpoint_every_steps=1", "checkpointer.keep_last=30",
                # an EMA that moves visibly in float32 at every step (the default 0.996 -> 1 would not)
                "scheduler.ema_start=0.5", "scheduler.ema_end=0.5"]
ENCODER = ("context_encoder.", "target_encoder.")


def optimizer_of(held_until: int) -> torch.optim.Optimizer:
    encoder, predictor = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    return torch.optim.AdamW([{"params": [encoder], HELD_UNTIL: held_until, "initial_lr": 1e-3},
                              {"params": [predictor]}], lr=1e-3)


@pytest.mark.parametrize("lr, after", [(5e-4, 5e-4), (None, 1e-3)])
def test_a_held_group_has_lr_0_before_its_step_and_the_schedules_after(lr, after):
    optimizer = optimizer_of(held_until=2)
    seen = []
    for step in range(4):
        apply_schedule(optimizer, lr, None, step)
        seen.append([group["lr"] for group in optimizer.param_groups])
    other = 1e-3 if lr is None else lr  # a constant schedule (None) leaves the LR as it was
    assert seen == [[0.0, other], [0.0, other], [after, other], [after, other]]


@pytest.mark.parametrize("applied", [None, True])
def test_the_accelerators_adamw_leaves_a_held_group_bit_identical_weight_decay_included(applied):
    """GatedAdamW (xla, cuda) with a held group's LR 0: no step and no decay, the moments moving."""
    from octfw.engine.optim import GatedAdamW

    torch.manual_seed(0)
    held, trained = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4, 3))
    optimizer = GatedAdamW([{"params": [held], HELD_UNTIL: 2}, {"params": [trained]}], lr=1e-2, weight_decay=0.05)
    start = held.detach().clone()
    verdict = None if applied is None else torch.tensor(applied)
    for step in range(3):
        apply_schedule(optimizer, 1e-2, None, step)
        (held.square().sum() + trained.square().sum()).backward()
        optimizer.step(verdict)
        optimizer.zero_grad(set_to_none=True)
        assert torch.equal(held, start) == (step < 2)
    assert optimizer.state[held]["exp_avg"].abs().sum() > 0


def test_the_ema_momentum_is_1_while_a_group_is_held():
    optimizer = optimizer_of(held_until=2)
    assert [held_momentum(optimizer, step, 0.99) for step in range(4)] == [1.0, 1.0, 0.99, 0.99]
    assert held_momentum(optimizer, 0, None) is None  # no EMA schedule: nothing to hold
    assert [held_momentum(optimizer_of(held_until=0), step, 0.99) for step in range(2)] == [0.99, 0.99]


# --- the default, and the load report ---------------------------------------------------------


def built(init: str | None, total: int = 0, **fields):
    config = VJEPA3DConfig(preset="tiny", patch_size=(2, 16, 16), init=init, position="rope", norm_eps=1e-6,
                           embed_dim=48, depth=2, num_heads=3, predictor_embed_dim=32, predictor_depth=2,
                           predictor_num_heads=2, **fields)
    ctx = BuildContext(recipe_dir=REPO, cache_dir=Path("."), run_dir=None, seed=0, image_size=(8, 32, 32),
                       in_channels=1, mask_pairs=("",), total_update_steps=total)
    return build(config, ctx)


def held(model) -> list[int]:
    return [group.get(HELD_UNTIL, 0) for group in model.param_groups(1.0)]


def test_a_new_predictor_holds_the_encoder_by_default_and_the_report_says_so():
    model = built(str(CHECKPOINT), total=10_000, init_predictor=False)
    assert model.predictor_warmup_steps == PREDICTOR_WARMUP_STEPS
    assert held(model) == [PREDICTOR_WARMUP_STEPS, PREDICTOR_WARMUP_STEPS, 0, 0]
    notes = [note for note in model.init_report.notes if "model.predictor_warmup_steps" in note]
    assert notes == [f"the encoder is held (learning rate 0, its EMA copy unchanged) for the first "
                     f"{PREDICTOR_WARMUP_STEPS} update steps while the new predictor trains "
                     "(model.predictor_warmup_steps)"]
    # The held groups are the context encoder's, every trainable parameter of it and no other.
    groups = model.param_groups(1.0)
    encoder = {id(p) for group in groups[:2] for p in group["params"]}
    assert encoder == {id(p) for p in model.context_encoder.parameters()}
    assert {id(p) for group in groups[2:] for p in group["params"]} == {id(p) for p in model.predictor.parameters()}


def test_the_default_is_at_most_a_tenth_of_the_run():
    assert built(str(CHECKPOINT), total=40, init_predictor=False).predictor_warmup_steps == 4


def test_a_continued_predictor_or_no_init_leaves_the_default_at_0():
    continued = built(str(CHECKPOINT), total=10_000)  # the fixture's predictor fits: it loads
    assert continued.predictor_warmup_steps == 0 and held(continued) == [0, 0, 0, 0]
    assert not any("predictor_warmup_steps" in note for note in continued.init_report.notes)
    fresh = built(None, total=10_000)
    assert fresh.predictor_warmup_steps is None and len(fresh.param_groups(1.0)) == 2  # the groups of old
    assert built(None, predictor_warmup_steps=5).predictor_warmup_steps == 5
    assert built(str(CHECKPOINT), init_predictor=False, predictor_warmup_steps=0).predictor_warmup_steps is None


# --- a run ---------------------------------------------------------------------------------------


def train_recording(recipe_path: Path, overrides: list[str], resume: str | None = None,
                    run_dir: Path | None = None) -> tuple[dict[int, dict[str, torch.Tensor]], Path]:
    """Train; the model's state as the trainer built (or restored) it and after each update step,
    by update steps done, and the run folder."""
    from octfw.engine.plan import planned_folder
    from octfw.engine.trainer import Trainer
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    registry = load_registry()
    recipe = load_recipe(recipe_path, overrides, registry)
    run_dir = run_dir or create_run_dir(recipe, registry)
    with planned_folder(recipe, registry, run_dir, resume) as plan:
        trainer = Trainer(plan, registry)
        seen = {trainer.start_step: {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}}
        update = trainer.update

        def recording(update_step: int):
            out = update(update_step)
            seen[update_step + 1] = {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}
            return out

        trainer.update = recording
        trainer.run()
    return seen, run_dir


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> bool:
    keys = [key for key in a if key.startswith(prefixes)]
    assert keys
    return all(torch.equal(a[key], b[key]) for key in keys)


@pytest.fixture
def weights(tiny_recipe) -> Path:
    shutil.copy(CHECKPOINT, tiny_recipe.parent / "weights.pt")
    return tiny_recipe


def test_a_warmup_of_n_keeps_the_encoder_bit_identical_for_n_steps_while_the_predictor_trains(weights):
    """The fixture's target_encoder is not its encoder: the EMA encoder is held by its momentum (1)."""
    after, _ = train_recording(
        weights, [*FROM_FIXTURE, "model.init_predictor=false", "model.predictor_warmup_steps=3", "run.max_steps=5"])
    assert sorted(after) == [0, 1, 2, 3, 4, 5]
    for step in (1, 2, 3):  # both encoders as they started, the predictor moving every step
        assert same(after[step], after[0], ENCODER)
        assert not same(after[step], after[step - 1], ("predictor.",))
    for step in (4, 5):  # then the encoder trains, and its EMA copy follows
        assert not same(after[step], after[step - 1], ("context_encoder.",))
        assert not same(after[step], after[step - 1], ("target_encoder.",))


def test_an_ema_encoder_started_from_the_encoder_stays_bit_identical_too(weights):
    """A published file without target_encoder (V-JEPA 2's, 2.1's distilled ones with their
    ema_encoder alone) starts both encoders alike: the EMA of a held copy of itself is itself."""
    state = torch.load(CHECKPOINT, weights_only=True)
    del state["target_encoder"]
    torch.save(state, weights.parent / "weights.pt")
    after, _ = train_recording(
        weights, [*FROM_FIXTURE, "model.init_predictor=false", "model.predictor_warmup_steps=2", "run.max_steps=3"])
    start = after[0]
    assert all(torch.equal(start[key], start[key.replace("target_", "context_", 1)])
               for key in start if key.startswith("target_encoder."))
    assert same(after[2], start, ENCODER)
    assert not same(after[3], after[2], ("target_encoder.",))


def test_without_a_warmup_the_encoder_moves_from_the_first_update(weights):
    after, _ = train_recording(
        weights, [*FROM_FIXTURE, "model.init_predictor=false", "model.predictor_warmup_steps=0", "run.max_steps=1"])
    assert not same(after[1], after[0], ("context_encoder.",))


def test_a_run_resumed_mid_warmup_holds_until_the_same_step(weights, tmp_path):
    # The default: 20 update steps hold the first 2 (a tenth); resumed after step 1, still held at step 2.
    overrides = [*FROM_FIXTURE, "model.init_predictor=false", "run.max_steps=20"]
    uninterrupted, run_dir = train_recording(weights, overrides)
    twin = tmp_path / "twin"
    shutil.copytree(run_dir, twin)
    for path in (twin / "checkpoints").glob("step_*.pt"):
        if int(path.stem.split("_")[1]) > 1:
            path.unlink()
    (twin / "checkpoints" / "latest").write_text("step_00000001.pt")
    (weights.parent / "weights.pt").unlink()  # a resumed run does not read init: the hold is its checkpoint's
    resumed, _ = train_recording(weights, overrides, resume="auto", run_dir=twin)
    assert min(resumed) == 1
    assert same(resumed[2], uninterrupted[0], ENCODER)
    assert not same(resumed[3], resumed[2], ("context_encoder.",))
    for step in (2, 3, 4):
        assert same(resumed[step], uninterrupted[step], ("context_encoder.", "target_encoder.", "predictor."))
