"""torch.compile of a training step: one graph, no graph break, no recompilation.

A graph break made torch.compile recompile the code resumed after it on every
update step (docs/performance.md). These tests capture graphs with dynamo
only (``explain``, ``eager`` and ``aot_eager`` backends): graph breaks and
recompilations are dynamo's decisions, the same under Inductor, which would
take minutes per test on a CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from octfw.diagnostics.graph_breaks import compile_report
from octfw.types import BuildContext, ModelOutput

IMAGE_SIZE = (8, 32, 32)
PATCH_SIZE = (4, 16, 16)  # 2 x 2 x 2 = 8 patches


@pytest.fixture(autouse=True)
def one_thread_and_fresh_dynamo():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def tiny_model(name: str) -> nn.Module:
    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                       image_size=IMAGE_SIZE, in_channels=1)
    if name == "vjepa3d":
        from octfw.plugins.models.vjepa3d import VJEPA3DConfig as Config, build
    else:
        from octfw.plugins.models.mae3d import MAE3DConfig as Config, build
    return build(Config(preset="tiny", patch_size=PATCH_SIZE), ctx)


def tiny_batch(model: nn.Module, batch_size: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = model.num_patches
    order = torch.stack([torch.randperm(n, generator=gen) for _ in range(batch_size)])
    shape = (batch_size, 1, *IMAGE_SIZE)
    return {"context": torch.randn(shape, generator=gen), "target": torch.randn(shape, generator=gen),
            "context_idx": order[:, n // 2:].contiguous(), "target_idx": order[:, :n // 2].contiguous(),
            "domain_id": torch.zeros(batch_size, dtype=torch.int64)}


@pytest.mark.parametrize("name", ["vjepa3d", "mae3d"])
def test_a_training_step_of_each_model_is_one_graph_without_a_break(name):
    """Forward and loss in one graph (explain's break_reasons: a break after the
    last graph, as ModelOutput's attrs __init__ made, counts too); the backward
    traced by AOTAutograd; a second step compiles nothing."""
    model = tiny_model(name)
    batch = tiny_batch(model)
    explained = torch._dynamo.explain(model)(batch)
    assert (explained.graph_count, explained.break_reasons) == (1, [])
    report = compile_report(model, batch)
    assert (report.graphs, report.breaks, report.recompilations) == (1, (), 0)
    assert report.summary().startswith("torch.compile: 1 graph, 0 graph breaks")


def test_model_output_is_built_inside_a_full_graph():
    def forward(x: torch.Tensor) -> ModelOutput:
        return ModelOutput(x.sum(), x, {"mean": x.mean()})

    out = torch.compile(forward, fullgraph=True, backend="eager")(torch.ones(3))
    assert isinstance(out, ModelOutput) and float(out.loss) == 3.0 and float(out.metrics["mean"]) == 1.0
    default = torch.compile(lambda x: ModelOutput(x.sum(), x), fullgraph=True, backend="eager")(torch.ones(2))
    assert default.metrics == {}
    with pytest.raises(AttributeError):  # still frozen
        out.loss = torch.zeros(())


def test_the_report_names_each_graph_break_and_where_it_is():
    class Talkative(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, batch):
            hidden = self.linear(batch["x"])
            print("a host call")  # dynamo cannot put print in a graph
            loss = hidden.square().mean()
            return ModelOutput(loss, hidden.square().mean(dim=1))

    report = compile_report(Talkative(), {"x": torch.randn(2, 4)})
    assert report.graphs == 2 and len(report.breaks) == 1 and not report.clean
    assert "print" in report.breaks[0].reason
    assert report.breaks[0].location.endswith(f"test_compile.py:{Talkative.forward.__code__.co_firstlineno + 2} "
                                              "in forward")
    assert report.summary().startswith("torch.compile: 2 graphs, 1 graph break in forward and loss")


def test_two_update_steps_of_a_compiled_trainer_do_not_recompile(tiny_recipe, monkeypatch):
    """The engine's own update step (loader, guards, AdamW, EMA around the compiled
    forward): after the first step compiled, the next two compile nothing."""
    from torch._dynamo.utils import counters

    from octfw.engine.trainer import Trainer
    from octfw.engine.plan import plan_for_folder
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    # aot_eager instead of Inductor: the same dynamo graphs and guards, seconds instead of minutes.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    registry = load_registry()
    recipe = load_recipe(tiny_recipe, ["engine.compile=true", "run.max_steps=4"], registry)
    trainer = Trainer(plan_for_folder(recipe, registry, create_run_dir(recipe, registry)), registry)
    counters.clear()
    trainer.update(0)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        trainer.update(1)
        trainer.update(2)
    assert counters["stats"]["unique_graphs"] == compiled
    assert not counters["graph_break"]


def test_ddp_of_the_compiled_model_splits_at_gradient_buckets_without_a_graph_break(monkeypatch):
    """DDP(torch.compile(model)), the engine's order: DDPOptimizer splits the
    graph at DDP's buckets (1 MiB first, then 25 MiB by default), and DDP's own
    forward stays out of dynamo."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from octfw.engine.backend import Backend, training_forward

    graphs: list[torch.fx.GraphModule] = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))  # 1 MiB of weights each

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        counters.clear()
        # a backend of two processes asks for DDP; its group here has one, which DDP runs on alike
        backend = Backend(kind="cpu", device=torch.device("cpu"), precision="fp32", world_size=2)
        forward = training_forward(Layers(), backend, compile=True)
        assert isinstance(forward, nn.parallel.DistributedDataParallel)
        for _ in range(2):
            forward(torch.randn(2, 512)).sum().backward()
        with forward.no_sync():  # the micro-steps before the last of an accumulation
            forward(torch.randn(2, 512)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert len(graphs) >= 2  # split by DDPOptimizer, compiled once
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_octfw_check_prints_the_graph_break_report(tiny_recipe, capsys):
    from octfw.cli.main import main

    code = main(["check", str(tiny_recipe), "--set", "engine.compile=true"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("compile"))
    assert "torch.compile: 1 graph, 0 graph breaks in forward and loss" in line
    assert "a second step recompiles nothing" in line
    assert "graph break at" not in out and "check passed" in out


def test_octfw_check_without_compile_prints_no_graph_report(tiny_recipe, registry):
    from octfw.diagnostics.check import check_recipe
    from octfw.recipe import load_recipe

    lines: list[str] = []
    result = check_recipe(load_recipe(tiny_recipe, (), registry), registry, report=lines.append)
    assert result["compile"] is None and not any(line.startswith("compile") for line in lines)
