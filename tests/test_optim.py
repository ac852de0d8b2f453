"""GatedAdamW, the engine's optimizer on accelerators: torch's AdamW arithmetic,
a device-side veto that leaves everything as it was, and checkpoints that
move between the two. Its code is device-agnostic; these tests run it on CPU
tensors, tests/test_xla_engine.py runs it inside the engine on torch_xla."""

from __future__ import annotations

import copy

import pytest
import torch

from octfw.engine.optim import GatedAdamW

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))


def groups(model: torch.nn.Module) -> list[dict]:
    """Decay on weights, none on biases, as octfw's models group them."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.05}, {"params": biases, "weight_decay": 0.0}]


def backward(model: torch.nn.Module, step: int, poison: bool = False) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    if poison:
        for p in model.parameters():
            p.grad[..., 0] = float("nan")
            p.grad[..., -1] = float("inf")


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [t.clone() for p in model.parameters() for t in optimizer.state.get(p, {}).values()]
    return [p.detach().clone() for p in model.parameters()] + state


def assert_close_models(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("verdict", [None, True])
def test_applied_updates_match_torch_adamw(verdict):
    reference, gated = make_model(), make_model()
    torch_opt = torch.optim.AdamW(groups(reference), **HYPER)
    gated_opt = GatedAdamW(groups(gated), **HYPER)
    for step in range(25):
        for model in (reference, gated):
            backward(model, step)
        for g in torch_opt.param_groups + gated_opt.param_groups:
            g["lr"] = HYPER["lr"] * (1 - step / 50)  # a schedule rewrites the LR every update
        torch_opt.step()
        gated_opt.step(None if verdict is None else torch.tensor(verdict))
    assert_close_models(reference, gated)
    with torch.no_grad():
        moved = sum(float((p - q).abs().sum()) for p, q in zip(make_model().parameters(), gated.parameters()))
    assert moved > 0.1  # the comparison is not between two models that never moved


def test_a_vetoed_update_changes_nothing_and_later_updates_ignore_it():
    """Vetoes on the first update (no state yet) and on later ones, with NaN and
    inf gradients: the run equals torch's AdamW given only the applied updates."""
    reference, gated = make_model(), make_model()
    torch_opt = torch.optim.AdamW(groups(reference), **HYPER)
    gated_opt = GatedAdamW(groups(gated), **HYPER)
    vetoed = {0, 3, 4, 9}
    for step in range(14):
        if step in vetoed:
            backward(gated, step, poison=True)
            before = snapshot(gated, gated_opt)
            gated_opt.step(torch.tensor(False))
            after = snapshot(gated, gated_opt)
            if step == 0:  # no state before: the veto leaves it as a fresh one, all zeros
                params = len(list(gated.parameters()))
                assert all(not t.any() for t in after[params:]) and len(after) == 4 * params
                after = after[:params]
            assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))
            continue
        for model in (reference, gated):
            backward(model, step)
        torch_opt.step()
        gated_opt.step(torch.tensor(True))
    assert_close_models(reference, gated)
    counts = {float(s["step"]) for s in gated_opt.state.values()}
    assert counts == {14.0 - len(vetoed)}


def test_a_parameter_without_a_gradient_keeps_its_own_step_count():
    reference, gated = make_model(), make_model()
    torch_opt = torch.optim.AdamW(groups(reference), **HYPER)
    gated_opt = GatedAdamW(groups(gated), **HYPER)
    for step in range(12):
        for model, opt in ((reference, torch_opt), (gated, gated_opt)):
            backward(model, step)
            if 3 <= step < 7:  # the last layer's bias gets no gradient for four updates
                model[2].bias.grad = None
            opt.step()
    assert_close_models(reference, gated)
    assert float(gated_opt.state[gated[2].bias]["step"]) == 8.0
    assert float(gated_opt.state[gated[0].bias]["step"]) == 12.0


@pytest.mark.parametrize("source, target", [(GatedAdamW, torch.optim.AdamW), (torch.optim.AdamW, GatedAdamW)])
def test_a_checkpoint_moves_between_torch_adamw_and_gated_adamw(source, target):
    """A run saved on a TPU (GatedAdamW) resumes or replays on the CPU (torch's AdamW), and back.
    GatedAdamW's groups share one step count in memory; torch's AdamW given a
    shared one would count it once per parameter."""
    first, reference = make_model(), make_model()
    saved_opt, reference_opt = source(groups(first), **HYPER), torch.optim.AdamW(groups(reference), **HYPER)
    for step in range(6):
        for model, opt in ((first, saved_opt), (reference, reference_opt)):
            backward(model, step)
            opt.step()
    state = copy.deepcopy(saved_opt.state_dict())
    resumed = copy.deepcopy(first)
    resumed_opt = target(groups(resumed), **HYPER)
    resumed_opt.load_state_dict(state)
    for step in range(6, 12):
        for model, opt in ((resumed, resumed_opt), (reference, reference_opt)):
            backward(model, step)
            opt.step()
    assert_close_models(reference, resumed)


def test_loaded_step_counts_of_a_group_share_one_tensor_again():
    """One bias correction per group and counter: after loading, equal counts
    of a group are one tensor again, unequal ones stay apart."""
    model = make_model()
    opt = torch.optim.AdamW(groups(model), **HYPER)
    for step in range(5):
        backward(model, step)
        if step == 4:
            model[2].bias.grad = None
        opt.step()
    gated = GatedAdamW(groups(copy.deepcopy(model)), **HYPER)
    gated.load_state_dict(opt.state_dict())
    counters = [{id(gated.state[p]["step"]) for p in g["params"]} for g in gated.param_groups]
    assert [len(c) for c in counters] == [1, 2]  # weights share one; biases: 5 updates and 4
    assert counters[0].isdisjoint(counters[1])
