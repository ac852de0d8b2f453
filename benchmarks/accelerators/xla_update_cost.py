"""What an XLA update step costs: compile time, compilations, the collectives
XLA's SPMD partitioner inserts (against the gradients' bytes) and what
``F.scaled_dot_product_attention`` lowers to, for the real engine on
torch_xla's CPU device with 4 virtual SPMD devices (``CPU_NUM_DEVICES=4``).

The seeds' recipe (recipes/smoke_test.toml over multi_domain.toml: bf16
autocast, AdamW, nan-skip / grad-clip / lr-positive guards, EMA, random
masking at 0.6, per-device batch 1) on synthetic volumes. Two measurements,
each in a process of its own (torch_xla patches torch process-wide), with
XLA's default compiler options and every compiled module dumped as HLO text:

- ``steps``: tiny, full depth, at the smoke test's size [16, 128, 128] (256
  tokens), gradient accumulation 2 as in the seeds: real update steps.
  Compilations and graphs per update step, compile seconds, and the
  collectives of the graphs that ran.
- ``compile``: tiny and small at the seeds' size [64, 384, 384] (9,216
  tokens), gradient accumulation 1 (``--accum``): the first update step's
  graph (one micro-step's forward and backward, the guards, AdamW and EMA)
  compiled but not run. The engine cuts the graph after every micro-step,
  so this is the largest graph an accumulated update runs too (its last
  micro-step's graph only adds the gradients carried over). A larger
  ``--accum`` is refused: compiling without running leaves the first
  micro-step's graph pending, and the next cut would compile every
  micro-step in one graph again. Running it
  is out of reach here: one attention layer's scores are 6 x 9,216^2 floats
  per device (2 GB in fp32, XLA:CPU's precision) and the machine has 23 GB
  for 4 devices and the other agents. Compile seconds, collectives against
  the gradients, the attention buffers and XLA's per-device memory.

The machine is shared (2 cores, other agents): compile times are indicative;
the load average is recorded. Prints a table and writes
``benchmarks/results/xla_update_cost.json``.

    python benchmarks/accelerators/xla_update_cost.py [--only steps|compile] [--presets tiny,small]

``--presets tiny`` keeps the other presets' compile entries of the previous
JSON, marked ``kept_from_earlier_run``; ``--only`` keeps the other part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import RESULTS, ROOT, machine, octfw_step, run_subprocess, write_result  # noqa: E402

from octfw.diagnostics.xla_hlo import compiled_modules, dump_flags, module_report, record_update_steps

SEEDS_SIZE = (64, 384, 384)
SMOKE_SIZE = (16, 128, 128)
PATCH = (4, 16, 16)
DEVICES = 4


def tokens(image: tuple[int, int, int]) -> int:
    return (image[0] // PATCH[0]) * (image[1] // PATCH[1]) * (image[2] // PATCH[2])


# --- worker side (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4, XLA dumping) -----------


def seeds_trainer(preset: str, image: tuple[int, int, int], accum: int, n_volumes: int, log_every: int, out: Path):
    """The real Trainer on the seeds' recipe, on xla, with synthetic volumes of ``image``."""
    from octfw.engine.trainer import Trainer
    from octfw.engine.plan import plan_for_folder
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    registry = load_registry()
    recipe = load_recipe(ROOT / "recipes" / "smoke_test.toml", [
        "run.device=xla", f"run.output_dir={json.dumps(str(out))}", "run.max_steps=1000",
        "engine.per_device_batch=1", f"engine.grad_accum_steps={accum}", "engine.num_workers=0",
        f"engine.log_every_steps={log_every}", "engine.checkpoint_every_steps=100000",
        f"transform.image_size=[{image[0]},{image[1]},{image[2]}]", f"model.preset={preset}",
        f"dataset.n_volumes={n_volumes}", 'logger=[{name="jsonl"}]'], registry)
    return Trainer(plan_for_folder(recipe, registry, create_run_dir(recipe, registry)), registry)


def gradients(trainer) -> dict[str, Any]:
    params = trainer.parameters
    return {"count": len(params), "sizes": [p.numel() for p in params],
            "bytes": sum(p.numel() * p.element_size() for p in params),
            "elements": sum(p.numel() for p in params)}


def steps_worker(preset: str, image: tuple[int, int, int], steps: int, log_every: int, dump: Path) -> dict:
    with tempfile.TemporaryDirectory() as out:
        trainer = seeds_trainer(preset, image, accum=2, n_volumes=16, log_every=log_every, out=Path(out))
        for logger in trainer.parts.loggers:  # as Trainer.run does before its loop
            logger.start(trainer.total, trainer.run_dir, trainer.parts.ctx.recipe)
        with record_update_steps(dump) as rows:
            for step in range(steps):
                octfw_step(trainer, step, (step + 1) % log_every == 0)
    rows[0].pop("trainer")
    grads = gradients(trainer)
    compiled_in = {name: r["step"] for r in rows for name in r["compiled"]}
    modules = [{**module_report(path, grads["sizes"], [tokens(image)]),
                "compiled_in_update_step": compiled_in.get(path.name)} for path in compiled_modules(dump)]
    return {"preset": preset, "image_size": list(image), "tokens": tokens(image), "grad_accum_steps": 2,
            "log_every": log_every, "rows": rows, "modules": modules, "gradients": grads,
            "heads": heads(trainer), "precision": trainer.backend.precision,
            "device_count": trainer.backend.device_count}


def heads(trainer) -> dict[str, int]:
    model = trainer.model
    return {"encoder": model.context_encoder.blocks[0].attn.num_heads,
            "predictor": model.predictor.blocks[0].attn.num_heads,
            "encoder_depth": len(model.context_encoder.blocks), "predictor_depth": len(model.predictor.blocks)}


def compile_worker(preset: str, image: tuple[int, int, int], accum: int, dump: Path) -> dict:
    import gc

    import torch
    import torch_xla

    import octfw.engine.trainer as trainer_module

    loaders = []
    real_make_loader = trainer_module.make_loader

    def capturing_make_loader(*args, **kwargs):
        loaders.append(real_make_loader(*args, **kwargs))
        return loaders[-1]

    trainer_module.make_loader = capturing_make_loader
    with tempfile.TemporaryDirectory() as out:
        trainer = seeds_trainer(preset, image, accum=accum, n_volumes=DEVICES * accum, log_every=2, out=Path(out))
        # One update step's micro-batches, uploaded once: the engine's loader would
        # prefetch 24 of them (300 MB each at this size) ahead of a step that never runs.
        host = iter(loaders[0])
        host_batches = [next(host) for _ in range(accum)]
        context = int(host_batches[0]["tensors"]["context_idx"].shape[1])
        trainer.batches = iter(trainer.backend.device_batches(host_batches, trainer.parts.transform.batch_spec()))

        def compile_only(backend) -> None:
            # What torch_xla.sync() would compile (every live XLA tensor), compiled and
            # cached but not executed.
            live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "xla"]
            torch_xla._XLAC._xla_warm_up_cache(live, [])

        type(trainer.backend).step_boundary = compile_only  # a slotted attrs class: patched on the class
        with record_update_steps(dump) as rows:
            trainer.update(0)
    rows[0].pop("trainer")
    grads = gradients(trainer)
    modules = [module_report(path, grads["sizes"], sorted({tokens(image), context}))
               for path in compiled_modules(dump)]
    return {"preset": preset, "image_size": list(image), "tokens": tokens(image), "context_tokens": context,
            "grad_accum_steps": accum, "rows": rows, "modules": modules, "gradients": grads, "heads": heads(trainer),
            "precision": trainer.backend.precision, "device_count": trainer.backend.device_count}


# --- parent side ----------------------------------------------------------


def run_worker(args: list[str], timeout: float) -> dict:
    """One worker's JSON, or what went wrong (a worker that runs out of memory or
    time is a result too: the report says so instead of losing the other figures)."""
    with tempfile.TemporaryDirectory() as dump:
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES), "XLA_HLO_DEBUG": "1",
               "XLA_FLAGS": dump_flags(dump)}
        started = time.perf_counter()
        try:
            out = run_subprocess([sys.executable, __file__, "--worker", *args, "--dump", dump], env=env,
                                 timeout=timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return {"args": args, "error": str(exc)[-3000:], "process_s": time.perf_counter() - started}
        result = json.loads(out.strip().splitlines()[-1])
        result["process_s"] = time.perf_counter() - started
        return result


def training_graphs(result: dict) -> list[dict]:
    return [m for m in result["modules"] if m["gradient_rounds"] > 0]


def attention_summary(result: dict) -> dict[str, Any]:
    """What the attention of the largest graph materialises, per device."""
    graph = max(training_graphs(result), key=lambda m: m["collectives"]["all-reduce"]["bytes"])
    full = [b for b in graph["attention_buffers"] if b["tokens"] == result["tokens"]]
    dots = graph["attention_score_dots_before_optimization"]
    largest = max(full, key=lambda b: b["bytes"]) if full else None
    return {"score_dots_before_optimization": sorted({(d["dtype"], tuple(d["dims"])) for d in dots}),
            "buffers_of_n_x_n": len(full), "largest_n_x_n_buffer": largest,
            "n_x_n_bytes_all_buffers": sum(b["bytes"] for b in full)}


def summarize_steps(result: dict) -> dict[str, Any]:
    rows = result["rows"]
    warm = result["log_every"] + 2
    steady = rows[warm:]
    graphs = training_graphs(result)
    return {
        "compiles_per_step": [r["compiles"] for r in rows],
        "compile_s_per_step": [round(r["compile_s"], 2) for r in rows],
        "compiles_after_warm_up": sum(r["compiles"] for r in steady),
        "graphs_executed_per_steady_step": sorted({r["executions"] for r in steady}),
        "first_step_wall_s": rows[0]["wall_s"], "steady_step_wall_s": statistics.median(r["wall_s"] for r in steady),
        "compile_s_total": sum(r["compile_s"] for r in rows),
        "training_graphs": [{"name": g["name"], "all_reduce": g["collectives"].get("all-reduce"),
                             "all_gather": g["collectives"].get("all-gather"), "rounds": g["gradient_rounds"],
                             "gradient_bytes": g["gradient_bytes"], "extra_bytes": g["extra_bytes"],
                             "memory_bytes": g["memory_bytes"], "compiled_in_update_step": g["compiled_in_update_step"]}
                            for g in graphs],
    }


def summarize_compile(result: dict) -> dict[str, Any]:
    graph = max(training_graphs(result), key=lambda m: m["collectives"]["all-reduce"]["bytes"])
    row = result["rows"][0]
    return {"compile_s": row["compile_s"], "compiles": row["compiles"], "step_wall_s": row["wall_s"],
            "all_reduce": graph["collectives"].get("all-reduce"), "all_gather": graph["collectives"].get("all-gather"),
            "rounds": graph["gradient_rounds"], "missing": graph["missing"],
            "gradient_bytes": graph["gradient_bytes"], "extra_bytes": graph["extra_bytes"],
            "extra": graph["extra"], "memory_bytes": graph["memory_bytes"], "attention": attention_summary(result)}


def compact(result: dict) -> dict:
    """The result as written to JSON: each module's N x N buffers folded into a
    count and a byte total per token count (small has dozens of them)."""
    for module in result.get("modules", []):
        if "attention_buffers" not in module:  # folded already (kept from an earlier run)
            continue
        folded: dict[int, dict[str, Any]] = {}
        for b in module.pop("attention_buffers", []):
            entry = folded.setdefault(b["tokens"], {"tokens": b["tokens"], "count": 0, "bytes": 0, "largest": None})
            entry["count"] += 1
            entry["bytes"] += b["bytes"]
            if entry["largest"] is None or b["bytes"] > entry["largest"]["bytes"]:
                entry["largest"] = b
        module["attention_buffers_by_tokens"] = list(folded.values())
    return result


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def report(results: dict[str, Any]) -> None:
    for failed in [results.get("steps", {}), *results.get("compile", [])]:
        if "error" in failed:
            print(f"FAILED after {failed['process_s']:.0f} s: {' '.join(failed['args'])}\n{failed['error'][-800:]}")
    if "summary" in results.get("steps", {}):
        r, s = results["steps"], results["steps"]["summary"]
        print(f"steps: {r['preset']} at {r['image_size']} ({r['tokens']} tokens), {r['device_count']} SPMD devices, "
              f"grad accum {r['grad_accum_steps']}, {len(r['rows'])} update steps")
        print(f"  compiles per update step: {s['compiles_per_step']} (after warm-up: {s['compiles_after_warm_up']})")
        print(f"  compile seconds per step: {s['compile_s_per_step']}")
        print(f"  graphs executed per steady update step: {s['graphs_executed_per_steady_step']}")
        print(f"  first step {s['first_step_wall_s']:.1f} s, steady step {s['steady_step_wall_s']:.2f} s (waited)")
        for g in s["training_graphs"]:
            print(f"  graph {g['name']}: all-reduce {g['all_reduce']['count']} ops {mib(g['all_reduce']['bytes'])} "
                  f"({g['rounds']} x the gradients = {mib(g['gradient_bytes'])}, + {g['extra_bytes']} B), "
                  f"all-gather {g['all_gather'] and g['all_gather']['count']} ops "
                  f"{mib(g['all_gather'] and g['all_gather']['bytes'])}, XLA memory/device {mib(g['memory_bytes'])}")
    for r in (r for r in results.get("compile", []) if "summary" in r and not r.get("kept_from_earlier_run")):
        s, a = r["summary"], r["summary"]["attention"]
        grads = r["gradients"]
        print(f"compile: {r['preset']} at {r['image_size']} ({r['tokens']} tokens, {r['context_tokens']} visible), "
              f"{grads['count']} gradient tensors, {mib(grads['bytes'])}")
        print(f"  update graph (accumulation {r['grad_accum_steps']}) compiled in {s['compile_s']:.1f} s "
              f"({s['compiles']} compilations in the step)")
        print(f"  all-reduce: {s['all_reduce']['count']} ops, {mib(s['all_reduce']['bytes'])} = {s['rounds']} x the "
              f"gradients ({mib(s['gradient_bytes'])}) + {s['extra_bytes']} B of loss/metric sums; "
              f"all-gather: {s['all_gather'] and s['all_gather']['count']} ops "
              f"{mib(s['all_gather'] and s['all_gather']['bytes'])}")
        print(f"  attention: score matmuls {a['score_dots_before_optimization']} as emitted; per device "
              f"{a['buffers_of_n_x_n']} buffers of N x N, largest {a['largest_n_x_n_buffer']}")
        print(f"  XLA:CPU buffer assignment per device: {mib(s['memory_bytes'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["steps", "compile"])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker process")
    parser.add_argument("--worker", choices=["steps", "compile"], help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--image", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation of the compiled update step")
    args = parser.parse_args()
    if args.accum != 1:
        parser.error("--accum: only 1; the engine cuts the graph after each micro-step, which compile-only "
                     "cannot do (nothing runs, so the next graph would hold every micro-step again)")
    if args.worker:
        image = tuple(int(x) for x in args.image.split(","))
        if args.worker == "steps":
            out = steps_worker(args.preset, image, args.steps, args.log_every, Path(args.dump))
        else:
            out = compile_worker(args.preset, image, args.accum, Path(args.dump))
        print(json.dumps(out))
        return

    results: dict[str, Any] = {"load_average_before": os.getloadavg()}
    previous = RESULTS / "xla_update_cost.json"
    kept: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    # The part not re-run keeps its figures (the part re-run replaces them below).
    results.update({k: kept[k] for k in ("steps", "compile") if k in kept and k != args.only})
    if args.only in (None, "steps"):
        r = run_worker(["steps", "--preset", "tiny", "--image", ",".join(map(str, SMOKE_SIZE)),
                        "--steps", str(args.steps), "--log-every", str(args.log_every)], args.timeout)
        results["steps"] = r if "error" in r else {**r, "summary": summarize_steps(r)}
    if args.only in (None, "compile"):
        results["compile"] = []
        for preset in args.presets.split(","):
            started_load = os.getloadavg()
            r = run_worker(["compile", "--preset", preset, "--image", ",".join(map(str, SEEDS_SIZE)),
                            "--accum", str(args.accum)], args.timeout)
            summary = {} if "error" in r else {"summary": summarize_compile(r)}
            results["compile"].append({**r, "preset": preset, "load_average_before": started_load, **summary})
        rerun = set(args.presets.split(","))
        results["compile"] += [{**r, "kept_from_earlier_run": True} for r in kept.get("compile", [])
                               if r["preset"] not in rerun]
    results["load_average_after"] = os.getloadavg()
    report(results)
    for r in [results.get("steps", {}), *results.get("compile", [])]:
        compact(r)
    path = write_result("xla_update_cost", {"machine": machine(), "devices": DEVICES, **results})
    print(f"written {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
