"""Shared by the benchmark scripts: the real Trainer fed from batches built once
in memory, and the hand-written PyTorch loop it is compared with.

Both sides get the same model (a deep copy taken before any step), the same
batches (already on the device, so data loading is excluded) and AdamW with
octfw's parameter groups: the engine's own implementation, or torch's.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def random_quickstart_encoder(overrides: list[str] | None = None) -> tuple[Any, Any, torch.nn.Module]:
    """(registry, build context, model) of the quickstart recipe with its model randomly
    initialised from seed 0, in eval mode: ``octfw eval``'s random baseline, which the
    reader benchmarks read."""
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    registry = load_registry()
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml", overrides or [], registry)
    ctx = recipe.build_context(registry=registry)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = recipe.model.build(ctx).eval()
    return registry, ctx, model


def default_attentive_grid() -> dict[str, Any]:
    """Keyword arguments of ``fit_attentive_grid`` that ``attentive-probe`` uses by default."""
    from octfw.plugins.evaluators.attentive_probe import AttentiveProbeConfig

    defaults = AttentiveProbeConfig(dataset={"name": "phantom-oct"})
    return dict(learning_rates=defaults.learning_rates, weight_decays=defaults.weight_decays,
                num_heads=defaults.num_heads, max_epochs=defaults.max_epochs, patience=defaults.patience,
                batch_size=defaults.fit_batch_size, seed=defaults.seed)


def attentive_probe_parts(registry: Any, ctx: Any, model: torch.nn.Module, dataset: dict[str, Any],
                          split_seed: int) -> dict[str, torch.Tensor]:
    """The tokens ``attentive-probe`` reads on one split of ``dataset``, as it draws them:
    ``fit``, ``val`` and ``test`` tokens ``[N, T, E]`` (float32) and their class indices
    ``fit_y``, ``val_y``, ``test_y``."""
    import numpy as np

    from octfw.recipe import build_component

    table = {"name": "attentive-probe", "dataset": dataset, "split_seed": split_seed, "bootstrap": 0,
             "token_dtype": "float32"}
    evaluator = build_component(registry, "evaluator", table, ctx, "attentive-probe")
    with torch.no_grad():
        encoded = evaluator.encode(model, torch.device("cpu"))
    train, test = evaluator.split()
    classes = np.unique(train.labels)
    fit_positions, val_positions = evaluator.fit_val_positions()
    fit, fit_y = evaluator._train_part(encoded, fit_positions, classes)
    val, val_y = evaluator._train_part(encoded, val_positions, classes)
    return {"fit": fit, "fit_y": fit_y, "val": val, "val_y": val_y, "test": encoded.test,
            "test_y": torch.from_numpy(np.searchsorted(classes, test.labels))}


def machine() -> dict[str, Any]:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["load_average_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def forget_compiled() -> None:
    """Drop every graph dynamo compiled and what it learnt of shapes, before a compiled
    trainer is built. Without it, a compiled trainer built after another one that ran
    another batch size compiles a dynamic-shape graph (dynamo's automatic dynamic
    shapes remember the earlier size per code object, across model instances), not
    the static graph a run at one batch size compiles."""
    torch._dynamo.reset()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since the last :func:`forget_compiled` (recompilations included)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def make_trainer(recipe_path: Path, overrides: list[str], n_batches: int | None = 8):
    """The real Trainer, its loader replaced by ``n_batches`` pre-built device batches in a cycle
    (None: the engine's own loader kept, batches and all)."""
    from octfw.engine.trainer import Trainer
    from octfw.engine.plan import plan_for_folder
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    registry = load_registry()
    run_root = Path(tempfile.mkdtemp(prefix="octfw-bench-"))
    recipe = load_recipe(recipe_path, [f"run.output_dir={json.dumps(str(run_root))}", 'logger=[{name="jsonl"}]',
                                       "run.max_steps=100000", *overrides], registry)
    trainer = Trainer(plan_for_folder(recipe, registry, create_run_dir(recipe, registry)), registry)
    for logger in trainer.parts.loggers:  # as Trainer.run does before its loop
        logger.start(trainer.total, trainer.run_dir, trainer.parts.ctx.recipe)
    if n_batches is None:
        return trainer, []
    source_batches = []
    loader_items = trainer.batches  # the engine's own loader (already yields device tensors)
    for _ in range(n_batches):
        source_batches.append(next(loader_items))
    trainer.batches = itertools.cycle(source_batches)
    return trainer, [b["tensors"] for b in source_batches]


class HandLoop:
    """What one writes by hand: forward, backward (accumulated), optional clip,
    AdamW step, EMA, zero_grad; the loss read on the host at log steps.

    ``skip_on_host``: skip a non-finite update the way a hand-written loop
    does it, by reading the loss and gradient norm on the host every update.

    ``optimizer``: ``"octfw"`` builds the optimizer the engine builds
    (:func:`octfw.engine.optim.make_optimizer`: torch's multi-tensor AdamW
    on the CPU, octfw's GatedAdamW on accelerators), so the pair measures the
    engine's own code; ``"torch"`` builds ``torch.optim.AdamW`` with torch's
    defaults for the device, as one writes it by hand.
    """

    def __init__(self, trainer, batches: list[dict[str, torch.Tensor]], clip: float | None,
                 skip_on_host: bool = False, optimizer: str = "octfw"):
        from octfw.engine.optim import make_optimizer

        self.model = copy.deepcopy(trainer.model)
        if optimizer == "octfw":
            self.optimizer = make_optimizer(self.model, trainer.recipe, trainer.backend)
        else:
            engine = trainer.recipe.engine
            self.optimizer = torch.optim.AdamW(self.model.param_groups(engine.weight_decay), lr=engine.base_lr,
                                               betas=engine.betas, eps=engine.eps)
        self.batches = itertools.cycle(batches)
        self.schedule, self.engine, self.backend = trainer.parts.scheduler, trainer.recipe.engine, trainer.backend
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.clip, self.skip_on_host = clip, skip_on_host
        self.last_loss = None

    def step(self, update_step: int, log: bool) -> None:
        lr = self.schedule.lr(update_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = self.engine.grad_accum_steps
        loss = 0.0
        for _ in range(accum):
            with self.backend.forward_context():
                out = self.model(next(self.batches))
            (out.loss / accum).backward()
            if self.skip_on_host:
                loss = loss + out.loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip) if self.clip is not None else None
        if not self.skip_on_host or bool(torch.isfinite(loss) & torch.isfinite(norm)):  # a host sync
            self.optimizer.step()
            # A device tensor, as the engine passes it: a changing Python float would recompile on xla.
            momentum = torch.tensor(self.schedule.ema_momentum(update_step), device=self.backend.device)
            self.model.ema_update(momentum)
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.step_boundary()
        if log:
            self.last_loss = float(out.loss.detach())


def octfw_step(trainer, update_step: int, log: bool) -> None:
    """One iteration of Trainer.run's loop body: the update, and the log at log steps."""
    norm, out = trainer.update(update_step)
    trainer.heartbeat.beat(update_step + 1)
    if log:
        trainer.log(update_step + 1, norm, out)


def alternate(sides: dict[str, Callable[[int, bool], None]], rounds: int, block: int, log_every: int,
              sync: Callable[[], None], warm_up: int = 3) -> dict[str, list[float]]:
    """Per-step seconds of each side, measured in blocks of ``block`` steps that
    alternate between the sides (the first side changes every round)."""
    names = list(sides)
    counters = {n: 0 for n in names}

    def run_block(name: str, steps: int) -> float:
        sync()
        started = time.perf_counter()
        for _ in range(steps):
            counters[name] += 1
            sides[name](counters[name] - 1, counters[name] % log_every == 0)
        sync()
        return (time.perf_counter() - started) / steps

    for name in names:
        run_block(name, warm_up)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(run_block(name, block))
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def run_subprocess(args: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> str:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=full_env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def xla_side(script: str, args: list[str]) -> list[dict[str, Any]]:
    """The results of ``script --device xla --json-only ARGS``, run in its own
    process: torch_xla patches torch process-wide."""
    command = [sys.executable, script, "--device", "xla", "--json-only", *args]
    return json.loads(run_subprocess(command, env={"PJRT_DEVICE": "CPU"}).strip().splitlines()[-1])


def publish(name: str, results: list[dict[str, Any]], json_only: bool, report: Callable[[dict], None]) -> None:
    """One JSON line for the parent process (``--json-only``), else the
    summary lines and ``benchmarks/results/<name>.json``."""
    if json_only:
        print(json.dumps(results))
        return
    for result in results:
        report(result)
    path = write_result(name, {"machine": machine(), "results": results})
    print(f"written {path.relative_to(ROOT)}")
