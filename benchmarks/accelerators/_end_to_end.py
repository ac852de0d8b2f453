"""The accelerator suite's end-to-end mode: what a user's run gets, loader included.

``octfw prepare`` (the real command, in a subprocess) writes a synthetic
cohort into a uint8 zarr store at the measured size; the real Trainer then
streams it with its own loader (``prepared`` dataset, ``engine.num_workers``
workers, pinned memory, views converted on the device) into the update step.
The same trainer, after its timed steps, repeats one of those batches from
the device: the batch-on-device figure, so the ratio of the two is the
loader's cost and nothing else (same model, same compiled graph, same batch).

Per configuration (preset x compile) it records samples/s end to end and on
the device, the share of the timed steps spent waiting on the loader, MFU
against the published peak and a matmul measured in this process, peak
device memory against ``octfw check``'s estimate for that batch, and the
attention kernel that ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, compiled_graphs, forget_compiled, make_trainer  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart.toml"


def prepare_store(folder: Path, image_size: list[int], volumes: int, workers: int) -> tuple[Path, float]:
    """A uint8 prepared store of ``volumes`` synthetic volumes at ``image_size``; its path and
    the seconds ``octfw prepare`` took (cohort written first, then prepared)."""
    store = folder / "store"
    recipe = folder / "prepare.toml"
    recipe.write_text(RECIPE.read_text(encoding="utf-8"), encoding="utf-8")
    command = [sys.executable, "-m", "octfw.cli", "prepare", str(recipe), "--out", str(store), "--dtype", "uint8",
               "--workers", str(workers), f"--set=dataset.n_volumes={volumes}",
               f"--set=transform.image_size={json.dumps(image_size)}"]
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    return store, time.perf_counter() - started


def _timed_steps(trainer, first_step: int, count: int) -> tuple[float, float]:
    """(seconds, of which the host waited on the loader) for ``count`` update steps."""
    trainer.backend.synchronize()
    waited = trainer.throughput.data_wait_total_s
    started = time.perf_counter()
    for step in range(first_step, first_step + count):
        trainer.update(step)
    trainer.backend.synchronize()
    return time.perf_counter() - started, trainer.throughput.data_wait_total_s - waited


def end_to_end(store: Path, device: str, preset: str, image_size: list[int], batch: int, workers: int,
               compiled: bool, steps: int, warm_up: int, peaks: dict[str, float | None],
               on_result: Callable[[dict[str, Any]], None], profile: bool = False) -> dict[str, Any]:
    """One configuration, measured end to end and then batch-on-device, as described above; with
    ``profile``, two more steps on the device under torch's profiler (:func:`kernel_shares`)."""
    from octfw.diagnostics.attention import sdpa_call
    from octfw.diagnostics.memory import estimate_memory
    from octfw.models.flops import training_flops_per_sample

    row: dict[str, Any] = {"preset": preset, "batch": batch, "workers": workers, "compile": compiled,
                           "steps": steps}
    if compiled:
        forget_compiled()  # compiled at this batch and preset only, static shapes, as in a run
    trainer, _ = make_trainer(RECIPE, [
        f"run.device={device}", 'dataset={name="prepared", path=' + json.dumps(str(store)) + "}",
        f"transform.image_size={json.dumps(image_size)}", f"model.preset={preset}",
        f"engine.per_device_batch={batch}", "engine.grad_accum_steps=1",
        f"engine.precision={'bf16' if device == 'cuda' else 'fp32'}",
        f"engine.num_workers={workers}", "engine.log_every_steps=1000000",
        f"engine.compile={str(compiled).lower()}"], n_batches=None)
    try:
        started = time.perf_counter()
        graphs = compiled_graphs()
        _timed_steps(trainer, 0, warm_up)  # compile, allocator growth, optimizer state, workers started
        row["warm_up_s"] = time.perf_counter() - started
        warmed = compiled_graphs()
        cuda = device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds, waited = _timed_steps(trainer, warm_up, steps)
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
        row.update(end_to_end_s=seconds, samples_per_s=batch * steps / seconds, data_wait_share=waited / seconds)
        if compiled:  # 1 and 0 when the step is one graph compiled once
            row["compiled_graphs"], row["recompiled_while_timed"] = warmed - graphs, compiled_graphs() - warmed
        on_result(row)
        device_batch = next(trainer.batches)
        trainer.batches = iter(lambda: device_batch, None)  # the same batch, from the device, forever
        _timed_steps(trainer, warm_up + steps, 1)
        seconds, _ = _timed_steps(trainer, warm_up + steps + 1, steps)
        row.update(on_device_s=seconds, on_device_samples_per_s=batch * steps / seconds)
        row["end_to_end_ratio"] = row["samples_per_s"] / row["on_device_samples_per_s"]
        if profile:
            row["profile"] = kernel_shares(lambda: _timed_steps(trainer, warm_up + 2 * steps + 1, 2),
                                           cuda=device == "cuda")
        tensors = device_batch["tensors"]
        flops = training_flops_per_sample(trainer.model, {k: v[:1] for k, v in tensors.items()})
        row["flops_per_sample"] = flops
        for name, peak in peaks.items():
            row[f"mfu_{name}"] = flops * row["samples_per_s"] / peak if peak else None
            row[f"mfu_on_device_{name}"] = flops * row["on_device_samples_per_s"] / peak if peak else None
        row["estimate_bytes"] = estimate_memory(trainer.model, tensors, device=device,
                                                precision=trainer.backend.precision).total
        heads = trainer.model.encoder.blocks[0].attn.num_heads
        width = trainer.model.encoder.blocks[0].attn.qkv.in_features
        tokens = tensors["context_idx"].shape[1] + tensors["target_idx"].shape[1]
        row["attention_kernel"] = trainer.attention_kernels or sdpa_call(
            device, torch.bfloat16 if cuda else torch.float32, 1, heads, tokens, width // heads,
            priority=trainer.backend.attention_priority).kernel
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0]}"
    finally:
        del trainer
    on_result(row)
    return row


#: Kernel families by name, first match wins: where an update step's device time goes.
KERNEL_FAMILIES = (("attention", ("attn", "fmha", "flash", "cudnn", "sdpa")),
                   ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "matmul", "aten::mm", "addmm", "bmm")),
                   ("fused by inductor", ("triton_",)),
                   ("copy and layout", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter")))


def kernel_shares(run: Callable[[], Any], cuda: bool, top: int = 25) -> dict[str, Any]:
    """Device time of ``run`` by kernel under torch's profiler (on a CPU: operators' own CPU
    time): the ``top`` kernels and each family's share (:data:`KERNEL_FAMILIES`; the rest is
    "other"), so a low MFU says what to work on."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
    kernels = [(e.key, e.self_device_time_total if cuda else e.self_cpu_time_total) for e in prof.key_averages()]
    kernels = [(name, t) for name, t in kernels if t > 0]
    total = sum(t for _, t in kernels) or 1.0
    families: dict[str, float] = {}
    for name, t in kernels:
        lowered = name.lower()
        family = next((f for f, marks in KERNEL_FAMILIES if any(m in lowered for m in marks)), "other")
        families[family] = families.get(family, 0.0) + t / total
    ranked = sorted(kernels, key=lambda k: -k[1])[:top]
    return {"device_ms": total / 1e3, "families": families,
            "top": [{"kernel": name[:160], "ms": t / 1e3, "share": t / total} for name, t in ranked]}


def attention_kernels(heads: int, head_dim: int, tokens: int, repeats: int = 5) -> list[dict[str, Any]]:
    """Each SDPA kernel alone at one size in bf16, forward and backward: the median milliseconds
    and the largest output difference against the math kernel computed in fp32."""
    import statistics

    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    rows = []
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel([backend]):
                times = []
                for _ in range(repeats + 1):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                    out.float().sum().backward()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - started)
            diff = (out.float() - reference).abs().max().item()
            rows.append({"kernel": name, "ms_forward_backward": statistics.median(times[1:]) * 1e3,
                         "max_abs_diff_vs_fp32_math": diff})
        except RuntimeError as exc:  # the kernel does not take these inputs on this device
            rows.append({"kernel": name, "error": str(exc).splitlines()[0][:200]})
    return rows


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="octfw-e2e-"))
