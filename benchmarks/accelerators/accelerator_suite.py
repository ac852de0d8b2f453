"""Accelerator suite: the CUDA-marked tests, then throughput, MFU, memory and
batch size of ``small``, ``base`` and ``large`` (the published ViT-L's size) at the seeds'
[64, 384, 384] in bf16.

On a CUDA machine (``--device cuda``, or ``auto`` with a GPU visible):

1. ``pytest -m cuda`` (a subprocess): bf16 autocast, the device-side skip
   leaving parameters, moments and EMA bitwise unchanged, GatedAdamW against
   torch's fused AdamW, checkpoints moved between CUDA and the CPU
   (``tests/test_cuda_paths.py``), and the launcher on the GPUs: one process per GPU, each on
   ``cuda:LOCAL_RANK`` (``tests/test_multiprocess_faults.py``).
2. Attention: the scaled-dot-product-attention kernel the model's attention
   runs at 9,216 tokens for each preset's encoder and predictor heads, in bf16
   and fp32 (:mod:`octfw.diagnostics.attention`; the kernel that really ran, seen
   through the dispatched aten operator), and the kernels of one real
   training step.
3. Per preset, activation checkpointing off and on:

   - peak memory of an update step at batch 1 (``torch.cuda.max_memory_allocated``)
     against ``estimate_memory``, the estimate ``octfw check`` prints;
   - the largest per-device batch that fits: doubling, then bisection, each
     probe two update steps, ``torch.cuda.OutOfMemoryError`` meaning "does not
     fit" (the cache emptied after each probe); against ``largest_batch``'s
     prediction for the device's total memory;
   - samples/s at batch 1 and at the largest batch that fit, with
     ``torch.compile`` off and on: the real engine update step
     (``Trainer.update``: forward, backward, guards, GatedAdamW, EMA; built
     by ``_common.make_trainer`` from the quickstart recipe with the preset and
     size set), median over ``--steps`` steps after warm-up; the per-device
     batch is the engine's one real batch repeated, so the input pipeline is
     left out; compiled afresh for each batch size (dynamo reset first, so the
     graph has static shapes, as in a run at that batch), with the graphs
     compiled in warm-up and any recompiled in the timed steps recorded;
   - MFU: model FLOPs (``training_flops_per_sample``: forward with the EMA
     target encoder plus backward; the forward that activation checkpointing
     recomputes is not counted) times samples/s, over the device's published
     dense bf16 peak (``octfw.engine.throughput.KNOWN_PEAKS``, from NVIDIA's
     data sheets) and over a bf16 matmul peak measured in this process.

Without a GPU (``--device cpu``, or ``auto``) it runs the same measurements
at a size two CPU cores manage: ``tiny`` and ``small`` at [32, 128, 128],
fp32 (the engine's CPU precision), the batch search capped at 4, compile only
for the first preset at batch 1 without checkpointing (compiling takes
minutes there), attention at 9,216 tokens forward only. The CUDA tests are
run too and come back skipped. CPU memory is the process's peak resident size
(``VmHWM`` after ``echo 5 > /proc/self/clear_refs``) during one update step,
above the resident size at its start, plus the tensors resident before the
step (weights, EMA, buffers, AdamW moments, batch), counted; the suite
re-runs itself with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc gives every
freed tensor back to the kernel. "Fits" on the CPU means: within
``--cpu-budget`` (no out-of-memory error to catch there).

Writes ``benchmarks/results/accelerator_suite.json`` (CUDA) or
``accelerator_suite_cpu.json`` and prints a table.

``--mode end-to-end`` measures what a user's run gets instead
(``benchmarks/accelerators/_end_to_end.py``): the CUDA tests, each SDPA kernel alone at
the seeds' token count (time and largest difference against fp32 math), then
``octfw prepare`` writes a uint8 store and the real loader streams it with
``--workers`` workers into the update step, per preset with compile off and
on, against the same trainer fed one batch from the device. Its JSON,
``accelerator_suite_end_to_end.json``, is rewritten after every measurement,
so a suite stopped early (SIGTERM, a lease running out) leaves what it had.
``--store`` reads a store prepared before, ``--rows small:48:on,large:8:off`` picks each row's
preset, batch and compile, and ``--profile`` adds each row's device time by kernel family.

    scripts/accelerator_suite.sh [--device auto|cuda|cpu] [--presets small,base,large] [--steps 5]
    scripts/accelerator_suite.sh --mode end-to-end --batch 48 --workers 8 [--presets small,base,large]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, compiled_graphs, forget_compiled, machine, make_trainer, median, write_result  # noqa: E402
from model_efficiency import matmul_peak  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart.toml"
SEED_IMAGE = [64, 384, 384]  # the seeds' volume: 9,216 patches of [4, 16, 16]
SEED_PATCH = [4, 16, 16]
CUDA_PRESETS = ("small", "base", "large")
CUDA_DTYPE = torch.bfloat16
CPU_PRESETS = ("tiny", "small")
CPU_IMAGE = [32, 128, 128]  # 512 patches: about 1 s per small update step on 2 cores
CPU_DTYPE = torch.float32
CUDA_TESTS = ["tests/test_cuda_paths.py", "tests/test_multiprocess_faults.py",
              "tests/test_layer_segmentation.py"]  # where the cuda-marked tests live
MMAP_THRESHOLD = "65536"

GIB = 1024**3


# --- 1. the CUDA-marked tests --------------------------------------------------


def run_cuda_tests(paths: list[str]) -> dict[str, Any]:
    """``pytest -m cuda PATHS`` in a subprocess: its counts and exit code."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-rs", *paths]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)})
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)",
                                                     tail)}
    skip_reasons = sorted(set(re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", result.stdout)))
    return {"command": " ".join(command[1:]), "returncode": result.returncode, "summary": tail,
            "counts": counts, "skip_reasons": skip_reasons, "seconds": time.perf_counter() - started}


# --- 2. attention kernels --------------------------------------------------------


def attention_cases(presets: tuple[str, ...], image_size: list[int], patch: list[int]) -> list[dict[str, Any]]:
    """Each preset's encoder and predictor attention over every patch of a volume
    (the target encoder and the predictor see all of them)."""
    from octfw.plugins.models.vjepa3d.config import PRESETS

    tokens = 1
    for size, p in zip(image_size, patch):
        tokens *= size // p
    cases = []
    for preset in presets:
        sizes = PRESETS[preset]
        for part, width, heads in (("encoder", sizes["embed_dim"], sizes["num_heads"]),
                                   ("predictor", sizes["predictor_embed_dim"], sizes["predictor_num_heads"])):
            cases.append({"preset": preset, "part": part, "heads": heads, "head_dim": width // heads,
                          "tokens": tokens})
    return cases


def attention_section(device: str, cases: list[dict[str, Any]], dtype: torch.dtype,
                      backward: bool = True) -> list[dict[str, Any]]:
    """Each case with the kernel octfw's Attention runs (batch 1; with ``backward``,
    the backward is checked to run the same kernel)."""
    from octfw.diagnostics.attention import sdpa_call

    records = []
    for case in cases:
        call = sdpa_call(device, dtype, 1, case["heads"], case["tokens"], case["head_dim"], backward=backward)
        records.append({**case, "dtype": call.dtype, "masked": call.masked, "kernel": call.kernel,
                        "backward_checked": backward})
    return records


# --- 3. training steps ------------------------------------------------------------


class Config:
    """One trainer: a preset at a size, on a device, with or without activation
    checkpointing and torch.compile."""

    def __init__(self, preset: str, image_size: list[int], device: str, precision: str,
                 checkpointing: bool, compiled: bool):
        self.preset, self.image_size, self.device, self.precision = preset, image_size, device, precision
        self.checkpointing, self.compiled = checkpointing, compiled

    def build(self):
        """(trainer, its one real batch of one sample)."""
        trainer, _ = make_trainer(RECIPE, [
            f"run.device={self.device}", f"model.preset={self.preset}",
            f"transform.image_size={self.image_size}", "engine.per_device_batch=1",
            "engine.grad_accum_steps=1", "engine.log_every_steps=1000000", f"engine.precision={self.precision}",
            f"model.activation_checkpointing={str(self.checkpointing).lower()}",
            f"engine.compile={str(self.compiled).lower()}", "dataset.n_volumes=4"], n_batches=1)
        return trainer, next(trainer.batches)


def with_batch_size(batch: dict[str, Any], size: int) -> dict[str, Any]:
    """The engine's batch of one sample repeated to ``size`` samples (real tensors)."""
    tensors = {k: v.expand(size, *v.shape[1:]).contiguous() for k, v in batch["tensors"].items()}
    return {**batch, "tensors": tensors, "provenance": batch["provenance"] * size}


def release() -> None:
    """Free what the last probe left (trainers hold reference cycles) and, on
    CUDA, hand cached blocks back, so each measurement starts from the same place."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _resident_bytes(trainer, tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors alive between update steps: weights, EMA, buffers,
    AdamW moments and step counts, the batch."""
    model = [*trainer.model.parameters(), *trainer.model.buffers()]
    optimizer = [t for state in trainer.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    unique = {id(t): t for t in [*model, *optimizer, *tensors.values()]}
    return sum(t.numel() * t.element_size() for t in unique.values())


def measure_step_memory(trainer, batch: dict[str, Any], kind: str, step: Callable[[], None]) -> int:
    """Peak bytes of one update step (optimizer state already created)."""
    if kind == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    from octfw.diagnostics.device_memory import peak_rss_growth

    gc.collect()
    resident = _resident_bytes(trainer, batch["tensors"])
    return resident + peak_rss_growth(step)


class Probe:
    """Update steps of one trainer at chosen batch sizes."""

    def __init__(self, config: Config):
        release()  # the previous probe's trainer, now unreferenced
        if config.compiled:
            forget_compiled()  # compiled at the batch it will run: static shapes, as in a run
        self.config = config
        self.trainer, self.single = config.build()
        self.kind = self.trainer.backend.kind
        self.steps_done = 0

    def steps(self, size: int, count: int) -> list[float]:
        """``count`` update steps at ``size`` samples; seconds of each (device synchronised)."""
        trainer = self.trainer
        trainer.batches = itertools.repeat(with_batch_size(self.single, size))
        times = []
        for _ in range(count):
            trainer.backend.synchronize()
            started = time.perf_counter()
            trainer.update(self.steps_done)
            trainer.backend.synchronize()
            times.append(time.perf_counter() - started)
            self.steps_done += 1
        return times

    def peak_memory(self, size: int) -> int:
        """Peak bytes of an update step at ``size`` samples, after one warm-up step."""
        self.steps(size, 1)
        batch = with_batch_size(self.single, size)
        self.trainer.batches = itertools.repeat(batch)

        def step() -> None:
            self.trainer.update(self.steps_done)
            self.steps_done += 1

        return measure_step_memory(self.trainer, batch, self.kind, step)

    def fits(self, size: int, budget: int | None) -> tuple[bool, int | None]:
        """(whether an update step at ``size`` fits, its peak bytes when it ran)."""
        try:
            peak = self.peak_memory(size)
        except torch.cuda.OutOfMemoryError:
            peak = None
        self.trainer.optimizer.zero_grad(set_to_none=True)  # an OOM mid-step leaves gradients behind
        release()
        if peak is None:
            return False, None
        return (budget is None or peak <= budget), peak


def largest_fitting_batch(probe: Probe, budget: int | None, limit: int) -> tuple[int, dict[int, int | None]]:
    """The largest batch that fits, by the search ``largest_batch`` uses (doubling,
    then bisection) with real update steps; and each probe's peak."""
    from octfw.diagnostics.memory import largest_fitting

    peaks: dict[int, int | None] = {}

    def fits(size: int) -> bool:
        ok, peaks[size] = probe.fits(size, budget)
        print(f"  {probe.config.preset} checkpointing={probe.config.checkpointing}: batch {size} "
              f"{'fits' if ok else 'does not fit'}" + (f" ({peaks[size] / GIB:.2f} GiB)" if peaks[size] else ""),
              flush=True)
        return ok

    return largest_fitting(fits, limit), peaks


def memory_and_batch(probe: Probe, budget: int | None, device_bytes: int | None, limit: int) -> dict[str, Any]:
    """Peak memory at batch 1 against the estimate; the largest batch against the prediction."""
    from octfw.diagnostics.memory import estimate_memory, largest_batch

    config, kind, single = probe.config, probe.kind, probe.single["tensors"]
    estimate = estimate_memory(probe.trainer.model, single, device=kind, checkpointing=config.checkpointing,
                               precision=config.precision)
    measured = probe.peak_memory(1)
    release()
    largest, peaks = largest_fitting_batch(probe, budget, limit)
    limit_bytes = budget if budget is not None else device_bytes
    predicted = (largest_batch(probe.trainer.model, single, limit_bytes, device=kind,
                               checkpointing=config.checkpointing, limit=limit, precision=config.precision)
                 if limit_bytes is not None else None)
    return {"checkpointing": config.checkpointing, "peak_bytes_batch1": measured,
            "estimate_bytes_batch1": estimate.total, "estimate_parts_batch1": estimate.parts,
            "largest_batch": largest, "largest_batch_capped": largest >= limit,
            "predicted_largest_batch": predicted, "memory_limit_bytes": limit_bytes,
            "probe_peaks": {str(k): v for k, v in sorted(peaks.items())}}


def throughput(probe: Probe, batch: int, steps: int, warm_up: int, flops_per_sample: int) -> dict[str, Any]:
    """Samples/s and achieved FLOP/s of the engine's update step at ``batch`` samples."""
    config = probe.config
    row: dict[str, Any] = {"checkpointing": config.checkpointing, "compile": config.compiled, "batch": batch}
    try:
        started, graphs = time.perf_counter(), compiled_graphs()
        # Compilation, allocator growth, optimizer state.
        probe.steps(batch, warm_up)
        row["warm_up_s"] = time.perf_counter() - started
        warmed = compiled_graphs()
        times = probe.steps(batch, steps)
        if config.compiled:  # 1 and 0 when the step is one graph compiled once
            row["compiled_graphs"], row["recompiled_while_timed"] = warmed - graphs, compiled_graphs() - warmed
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0]}"
    probe.trainer.optimizer.zero_grad(set_to_none=True)
    release()
    if "error" in row:
        return row
    step_s = median(times)
    row.update(step_s=step_s, step_times_s=times, samples_per_s=batch / step_s,
               achieved_flops=flops_per_sample * batch / step_s,
               load_average_1m=os.getloadavg()[0])  # other jobs on the machine skew CPU timings
    return row


def preset_section(preset: str, image_size: list[int], device: str, precision: str, args,
                   budget: int | None, device_bytes: int | None) -> dict[str, Any]:
    """Memory, largest batch and throughput of one preset (one eager trainer per
    checkpointing setting, one compiled one each)."""
    from octfw.diagnostics.attention import describe, record_attention
    from octfw.models.flops import training_flops_per_sample

    print(f"{preset} at {image_size}, {precision}", flush=True)
    section: dict[str, Any] = {"image_size": image_size, "memory": [], "throughput": []}
    largest: dict[bool, int] = {}
    for checkpointing in (False, True):
        probe = Probe(Config(preset, image_size, device, precision, checkpointing, False))
        if not checkpointing:
            model = probe.trainer.model
            section["parameters"] = model.count_parameters()
            section["flops_per_sample"] = training_flops_per_sample(model, probe.single["tensors"])
            probe.steps(1, 1)
            with record_attention() as record:  # one real training step, as the engine runs it
                probe.steps(1, 1)
            section["step_attention"] = describe(record)
            section["step_attention_backward"] = sorted(set(record.backward_kernels))
            del model
        memory = memory_and_batch(probe, budget, device_bytes, args.max_batch)
        section["memory"].append(memory)
        largest[checkpointing] = memory["largest_batch"]
        if False in args.compile:
            for size in sorted({1, max(largest[checkpointing], 1)}):
                section["throughput"].append(throughput(probe, size, args.steps, 1, section["flops_per_sample"]))
                print(f"  {_row_line(section['throughput'][-1])}", flush=True)
        del probe
    if True in args.compile and (device == "cuda" or preset == args.presets[0]):
        # On the CPU compiling takes minutes: the first preset at batch 1 without checkpointing only.
        for checkpointing in (False, True) if device == "cuda" else (False,):
            sizes = sorted({1, max(largest[checkpointing], 1)}) if device == "cuda" else [1]
            for size in sizes:
                # A fresh compiled probe per batch size: one probe compiled at batch 1 then run
                # at the large batch recompiled it with a dynamic batch dimension, a graph no
                # run at that batch would use.
                probe = Probe(Config(preset, image_size, device, precision, checkpointing, True))
                section["throughput"].append(throughput(probe, size, args.steps, 3, section["flops_per_sample"]))
                print(f"  {_row_line(section['throughput'][-1])}", flush=True)
                del probe
    return section


# --- report -------------------------------------------------------------------------


def _row_line(row: dict[str, Any]) -> str:
    head = f"checkpointing {'on ' if row['checkpointing'] else 'off'} compile {'on ' if row['compile'] else 'off'} " \
           f"batch {row['batch']:>3}"
    if "error" in row:
        return f"{head}: {row['error']}"
    return (f"{head}: {row['samples_per_s']:.3g} samples/s ({row['step_s'] * 1e3:.0f} ms/step, "
            f"warm-up {row['warm_up_s']:.1f} s)")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def table(result: dict[str, Any]) -> str:
    peak_names = [k for k, v in result["peaks_flops"].items() if v]
    lines = ["| preset | act. ckpt | compile | batch | samples/s | ms/step | "
             + " | ".join(f"MFU ({n.replace('_', ' ')})" for n in peak_names) + " |",
             "|" + " --- |" * (6 + len(peak_names))]
    for preset, section in result["presets"].items():
        for row in section["throughput"]:
            cells = [preset, "on" if row["checkpointing"] else "off", "on" if row["compile"] else "off",
                     str(row["batch"])]
            if "error" in row:
                cells += [row["error"][:40], "-"] + ["-"] * len(peak_names)
            else:
                cells += [f"{row['samples_per_s']:.3g}", f"{row['step_s'] * 1e3:.0f}"]
                cells += [f"{row[f'mfu_{n}']:.1%}" for n in peak_names]
            lines.append("| " + " | ".join(cells) + " |")
    if any((row.get("mfu_measured_matmul_peak") or 0) > 1 for s in result["presets"].values()
           for row in s["throughput"]):
        lines.append("\nMFU above 100 %: the matmul peak was measured while the machine was busier "
                     "than during that step (see load_average_1m in the JSON).")
    lines += ["", "| preset | act. ckpt | peak GiB (batch 1) | estimate GiB | largest batch | predicted |",
              "| --- | --- | --- | --- | --- | --- |"]
    for preset, section in result["presets"].items():
        for m in section["memory"]:
            largest = f"{m['largest_batch']}{'+' if m['largest_batch_capped'] else ''}"
            lines.append(f"| {preset} | {'on' if m['checkpointing'] else 'off'} | {_gib(m['peak_bytes_batch1'])} | "
                         f"{_gib(m['estimate_bytes_batch1'])} | {largest} | {m['predicted_largest_batch']} |")
    lines += ["", "| preset | part | heads x dim | tokens | dtype | kernel |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["attention"]:
        lines.append(f"| {r['preset']} | {r['part']} | {r['heads']} x {r['head_dim']} | {r['tokens']:,} | "
                     f"{r['dtype']} | {r['kernel']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--presets", help="comma-separated (default: small,base,large on cuda; tiny,small on cpu)")
    parser.add_argument("--image-size", help="D,H,W (default: 64,384,384 on cuda; 32,128,128 on cpu)")
    parser.add_argument("--steps", type=int, help="timed update steps per throughput figure (default 5 cuda, 3 cpu)")
    parser.add_argument("--max-batch", type=int, help="cap of the batch search (default 256 cuda, 4 cpu)")
    parser.add_argument("--compile", default="both", choices=["both", "off", "on"])
    parser.add_argument("--cpu-budget", default="1GiB", help="memory a batch must fit in on the CPU")
    parser.add_argument("--tests", nargs="*", default=CUDA_TESTS, help="paths given to pytest -m cuda")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--mode", choices=["device", "end-to-end"], default="device",
                        help="device: batches built on the device, batch search; end-to-end: the real loader")
    parser.add_argument("--batch", type=int, help="end-to-end: per-device batch (default 48 cuda, 2 cpu)")
    parser.add_argument("--workers", type=int, default=8, help="end-to-end: loader workers")
    parser.add_argument("--volumes", type=int, default=48, help="end-to-end: volumes in the prepared store")
    parser.add_argument("--store", type=Path, help="end-to-end: a uint8 store prepared before at --image-size "
                        "(`octfw prepare --dtype uint8`), read instead of preparing one")
    parser.add_argument("--rows", help="end-to-end: preset:batch:compile,... (e.g. small:48:on,large:8:off), "
                        "instead of every preset x --compile at one --batch")
    parser.add_argument("--profile", action="store_true",
                        help="end-to-end: each row's device time by kernel, from two profiled steps")
    parser.add_argument("--name", default="", help="suffix of the result file (a run of some rows)")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        # Before any tensor exists: glibc reads it at start-up (see octfw.diagnostics.device_memory.peak_rss_growth).
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    from octfw.diagnostics.device_memory import device_memory
    from octfw.recipe.fields import parse_bytes
    from octfw.engine.throughput import published_peak

    cuda = device == "cuda"
    presets = args.presets = tuple(args.presets.split(",")) if args.presets else (
        CUDA_PRESETS if cuda else CPU_PRESETS)
    image_size = [int(x) for x in args.image_size.split(",")] if args.image_size else (
        SEED_IMAGE if cuda else CPU_IMAGE)
    dtype, precision = (CUDA_DTYPE, "bf16") if cuda else (CPU_DTYPE, "fp32")
    args.max_batch = args.max_batch or (256 if cuda else 4)
    args.steps = args.steps or (5 if cuda else 3)
    args.compile = {"both": [False, True], "off": [False], "on": [True]}[args.compile]
    budget = None if cuda else parse_bytes(args.cpu_budget)
    device_bytes = device_memory(device)[0] if cuda else budget

    result: dict[str, Any] = {"machine": machine(), "device": device, "precision": precision,
                              "image_size": image_size, "presets": {}}
    if cuda:
        result["device_name"] = torch.cuda.get_device_name(0)
    if args.mode == "end-to-end":
        end_to_end_mode(args, device, presets, image_size, result)
        return
    if not args.skip_tests:
        print(f"pytest -m cuda {' '.join(args.tests)}", flush=True)
        result["cuda_tests"] = run_cuda_tests(args.tests)
        print(f"  {result['cuda_tests']['summary']}", flush=True)
    # Attention at the seeds' 9,216 tokens on every device: the kernel choice
    # depends on the shapes, and the CPU check costs about a second per case.
    # small and base always: the seeds' question, whichever presets are timed.
    cases = attention_cases(tuple(dict.fromkeys((*presets, *CUDA_PRESETS))), SEED_IMAGE, SEED_PATCH)
    print(f"attention kernels at {cases[0]['tokens']:,} tokens", flush=True)
    # The backward at 9,216 tokens costs seconds per case on a CPU: forward only
    # there (tests/test_attention.py checks the backward kernel at model sizes).
    result["attention"] = attention_section(device, cases, dtype, backward=cuda) + (
        attention_section(device, cases, torch.float32) if cuda else [])  # what fp32 would run
    matmul_n = 8192 if cuda else 2048
    measured = [matmul_peak(matmul_n, dtype, device)]
    for preset in presets:
        result["presets"][preset] = preset_section(preset, image_size, device, precision, args,
                                                   budget, device_bytes)
        measured.append(matmul_peak(matmul_n, dtype, device))
    # The published peak (None for a CPU or an unlisted GPU) and the best
    # matmul of all measurements, taken before and after the model steps.
    peaks = {"published_peak": published_peak(result.get("device_name", "CPU")),
             "measured_matmul_peak": max(measured)}
    for section in result["presets"].values():
        for row in section["throughput"]:
            for name, peak in peaks.items():
                if "achieved_flops" in row:
                    row[f"mfu_{name}"] = row["achieved_flops"] / peak if peak else None
    result["peaks_flops"] = peaks
    result["matmul"] = {"n": matmul_n, "dtype": str(dtype), "measurements_flops": measured}
    print(table(result))
    path = write_result("accelerator_suite" if cuda else "accelerator_suite_cpu", result)
    print(f"written {path.relative_to(ROOT)}")


def end_to_end_mode(args, device: str, presets: tuple[str, ...], image_size: list[int],
                    result: dict[str, Any]) -> None:
    """``--mode end-to-end`` (see the module's docstring); the JSON rewritten after each step."""
    import signal

    import _end_to_end as e2e
    from octfw.engine.throughput import published_peak

    name = ("accelerator_suite_end_to_end" if device == "cuda" else "accelerator_suite_end_to_end_cpu") + (
        f"_{args.name}" if args.name else "")
    result["rows"] = []

    def save(row: dict[str, Any] | None = None) -> None:
        if row is not None and (not result["rows"] or result["rows"][-1] is not row):
            result["rows"].append(row)
        write_result(name, result)

    def stopped(signum, frame):  # a lease running out: keep what was measured
        save()
        raise SystemExit(f"stopped by signal {signum}; {name}.json holds what was measured")

    signal.signal(signal.SIGTERM, stopped)
    if not args.skip_tests:
        result["cuda_tests"] = run_cuda_tests(args.tests)
        print(f"pytest -m cuda: {result['cuda_tests']['summary']}", flush=True)
        save()
    if device == "cuda":
        from octfw.plugins.models.vjepa3d.config import PRESETS

        sizes = PRESETS[presets[0]]
        tokens = attention_cases(presets[:1], SEED_IMAGE, SEED_PATCH)[0]["tokens"]
        result["attention_kernels"] = e2e.attention_kernels(
            sizes["num_heads"], sizes["embed_dim"] // sizes["num_heads"], tokens)
        for row in result["attention_kernels"]:
            print(f"  attention {row}", flush=True)
        save()
    dtype = CUDA_DTYPE if device == "cuda" else CPU_DTYPE
    peaks = {"published_peak": published_peak(result.get("device_name", "CPU")),
             "measured_matmul_peak": matmul_peak(8192 if device == "cuda" else 1024, dtype, device)}
    result["peaks_flops"] = peaks
    if args.store:
        store = args.store
        result["prepare"] = {"store": str(store), "dtype": "uint8", "prepared_before": True}
    else:
        store, seconds = e2e.prepare_store(e2e.scratch(), image_size, args.volumes, args.workers)
        result["prepare"] = {"volumes": args.volumes, "seconds": seconds, "dtype": "uint8"}
        print(f"prepared {args.volumes} volumes in {seconds:.0f} s", flush=True)
    save()
    batch = args.batch or (48 if device == "cuda" else 2)
    rows = [(p, int(b), c == "on") for p, b, c in (spec.split(":") for spec in args.rows.split(","))] \
        if args.rows else [(p, batch, c) for p in presets for c in args.compile]
    for preset, size, compiled in rows:
        row = e2e.end_to_end(store, device, preset, image_size, size, args.workers, compiled,
                             args.steps, 3 if compiled else 2, peaks, save, profile=args.profile)
        print(f"  {preset} batch={size} compile={compiled}: " + ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            if k != "profile"), flush=True)
        if "profile" in row:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in row["profile"]["families"].items())
            print(f"    device time by kernel family: {shares}", flush=True)
            for kernel in row["profile"]["top"][:12]:
                print(f"    {kernel['share']:6.1%} {kernel['ms']:9.2f} ms  {kernel['kernel'][:110]}", flush=True)
        release()
    print(f"written {write_result(name, result).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
