"""``octfw bench``: throughput, memory and stability over a grid of recipe settings.

The seeds asked, before every throughput change, for one table: per-device
batch, gradient accumulation, throughput, stability. :func:`bench` trains
every combination of the ``--grid`` values (their cartesian product, each
applied as a ``--set`` override) for a few update steps, each in a fresh
``octfw run`` subprocess, so that a memory peak belongs to one combination
and torch_xla (which patches torch process-wide) stays isolated.

From each run's ``summary.json`` and ``metrics.jsonl``:

- samples/s: over the log intervals after the first one, which holds the
  warm-up (graph tracing and compilation on xla, allocator growth); a run
  with a single log interval reports the whole run, warm-up included. Logging
  is set to every ``max(1, steps // 5)`` update steps unless ``--set`` says
  otherwise;
- peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, the peak HBM use
  on a TPU, else the peak resident set size (RSS) of the subprocess;
- stable: the run exited normally, skipped no update and logged only finite
  losses.

Run this module as ``python -m octfw.diagnostics.bench CHILD_ARGS`` only through
:func:`bench`: the child runs ``octfw run`` and writes the device's memory
peak next to it.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import attrs

from octfw.display.errors import UserError
from octfw.display.tables import render_table

__all__ = ["BenchRow", "parse_grid", "combinations", "bench", "format_table", "write_csv"]

PEAK_FILE_ENV = "OCTFW_BENCH_PEAK_FILE"
CSV_COLUMNS = ("per_device_batch", "grad_accum_steps", "global_batch", "samples_per_s",
               "samples_per_s_per_device", "peak_memory_bytes", "peak_memory_kind", "stable",
               "skipped_updates", "last_loss", "overrides", "error")


@attrs.frozen
class BenchRow:
    """One combination's result."""

    overrides: tuple[str, ...]
    per_device_batch: int | None
    grad_accum_steps: int | None
    global_batch: int | None
    samples_per_s: float | None
    samples_per_s_per_device: float | None
    peak_memory_bytes: int | None
    peak_memory_kind: str
    stable: bool
    skipped_updates: int | None
    last_loss: float | None
    error: str | None = None


def _split_values(text: str) -> list[str]:
    """Split at commas outside brackets and quotes: ``[8,32,32],[16,64,64]`` is two values."""
    values, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(current.strip())
            current = ""
            continue
        current += ch
    values.append(current.strip())
    return values


def parse_grid(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``["engine.per_device_batch=1,2"]`` -> ``[("engine.per_device_batch", ["1", "2"])]``."""
    grid = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        parsed = _split_values(values) if sep else []
        if not key or "." not in key or not parsed or any(v == "" for v in parsed):
            raise UserError(f"--grid {spec!r}: expected table.key=v1,v2,..., e.g. engine.per_device_batch=1,2")
        if key in (k for k, _ in grid):
            raise UserError(f"--grid {spec!r}: {key} is already a grid axis")
        grid.append((key, parsed))
    return grid


def combinations(grid: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[str, ...]]:
    """The cartesian product of the grid, each combination as ``--set`` overrides, in grid order."""
    keys = [k for k, _ in grid]
    return [tuple(f"{k}={v}" for k, v in zip(keys, values))
            for values in itertools.product(*(vals for _, vals in grid))]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _steady_rate(lines: list[dict], summary: dict) -> tuple[float | None, float | None]:
    """(samples/s, samples/s per device) over the log intervals after the first."""
    steady = [m for m in lines[1:] if m.get("samples_per_s") and m.get("step_time_s")]
    if not steady:
        total = summary.get("samples_per_s")
        per_device = None
        if lines and lines[-1].get("samples_per_s") and lines[-1].get("samples_per_s_per_device"):
            per_device = total * lines[-1]["samples_per_s_per_device"] / lines[-1]["samples_per_s"]
        return total, per_device
    # Weighted by time: total samples over total seconds of the steady intervals.
    seconds = [m["step_time_s"] * m.get("updates_since_log", 1.0) for m in steady]
    samples = [m["samples_per_s"] * s for m, s in zip(steady, seconds)]
    devices = statistics.median(m["samples_per_s"] / m["samples_per_s_per_device"] for m in steady)
    rate = sum(samples) / sum(seconds)
    return rate, rate / devices


def _resolved_engine(run_dir: Path) -> dict:
    import tomllib

    recipe = run_dir / "recipe.toml"
    return tomllib.loads(recipe.read_text(encoding="utf-8")).get("engine", {}) if recipe.exists() else {}


def _run_child(recipe: Path, overrides: Sequence[str], out_dir: Path) -> tuple[int, str, int]:
    """Run one combination; (exit code, stderr tail, peak RSS of the child in bytes)."""
    peak_file = out_dir / "peak.json"
    command = [sys.executable, "-m", "octfw.diagnostics.bench", str(recipe)]
    for item in overrides:
        command += ["--set", item]
    env = {**os.environ, PEAK_FILE_ENV: str(peak_file)}
    with open(out_dir / "stdout.txt", "wb") as out, open(out_dir / "stderr.txt", "wb") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        # wait4 gives this child's own rusage: its peak RSS, not the maximum over all children.
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    stderr = (out_dir / "stderr.txt").read_text(encoding="utf-8", errors="replace")
    return child.returncode, stderr, usage.ru_maxrss * 1024  # Linux reports KiB


def run_combination(recipe: Path, overrides: Sequence[str], steps: int, work: Path,
                    base_overrides: Sequence[str] = ()) -> BenchRow:
    """Train one combination for ``steps`` update steps in a subprocess and read its results."""
    work.mkdir(parents=True, exist_ok=True)
    output = work / "runs"
    every = max(1, steps // 5)
    settings = [f"run.max_steps={steps}", "run.epochs=1000000", f"engine.log_every_steps={every}",
                f"run.output_dir={json.dumps(str(output))}", 'logger=[{name="jsonl"}]',
                *base_overrides, *overrides]
    code, stderr, rss = _run_child(recipe, settings, work)
    runs = sorted(output.glob("*/*/summary.json"))
    peak_file = work / "peak.json"
    device_peak = json.loads(peak_file.read_text()) if peak_file.exists() else {}
    peak, kind = (device_peak["bytes"], device_peak["kind"]) if device_peak else (rss, "peak RSS")
    empty = dict(per_device_batch=None, grad_accum_steps=None, global_batch=None, samples_per_s=None,
                 samples_per_s_per_device=None, skipped_updates=None, last_loss=None)
    if code != 0 or not runs:
        last = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or [f"exit code {code}"]
        return BenchRow(overrides=tuple(overrides), peak_memory_bytes=peak, peak_memory_kind=kind,
                        stable=False, error=last[0][:300], **empty)
    run_dir = runs[-1].parent
    summary = json.loads(runs[-1].read_text(encoding="utf-8"))
    lines = _read_jsonl(run_dir / "metrics.jsonl")
    engine = _resolved_engine(run_dir)
    rate, per_device = _steady_rate(lines, summary)
    batch, accum = engine.get("per_device_batch"), engine.get("grad_accum_steps")
    devices = round(rate / per_device) if rate and per_device else 1
    losses = [m.get("loss") for m in lines]
    finite = all(v is not None and math.isfinite(v) for v in losses) and bool(losses)
    skipped = int(summary.get("skipped_updates") or 0)
    return BenchRow(
        overrides=tuple(overrides), per_device_batch=batch, grad_accum_steps=accum,
        global_batch=batch * accum * devices if batch and accum else None,
        samples_per_s=rate, samples_per_s_per_device=per_device, peak_memory_bytes=peak,
        peak_memory_kind=kind, stable=finite and skipped == 0 and not summary.get("stopped"),
        skipped_updates=skipped, last_loss=summary.get("last_loss"),
    )


def bench(recipe: Path, grid: Sequence[tuple[str, Sequence[str]]], steps: int, *,
          base_overrides: Sequence[str] = (), work_dir: Path | None = None,
          report: Callable[[str], None] = print) -> list[BenchRow]:
    """Run every grid combination for ``steps`` update steps; one :class:`BenchRow` each."""
    if steps < 1:
        raise UserError(f"--steps {steps}: must be >= 1")
    if not Path(recipe).is_file():
        raise UserError(f"{recipe}: no such recipe file")
    combos = combinations(grid) or [()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="octfw-bench-") as tmp:
        root = Path(work_dir) if work_dir else Path(tmp)
        for i, overrides in enumerate(combos):
            report(f"bench {i + 1}/{len(combos)}: {' '.join(overrides) or '(recipe as is)'}")
            rows.append(run_combination(Path(recipe).resolve(), overrides, steps, root / f"combo{i:03d}",
                                        base_overrides))
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**2:,.0f} MiB"


def format_table(rows: Sequence[BenchRow]) -> str:
    """The table the seeds asked for, one line per combination; the memory kind in the header."""
    kinds = sorted({r.peak_memory_kind for r in rows})
    header = ("per_device_batch", "grad_accum", "global_batch", "samples/s", "samples/s/device",
              f"peak memory ({', '.join(kinds)})", "stable")
    body = [(_fmt(r.per_device_batch, "d"), _fmt(r.grad_accum_steps, "d"), _fmt(r.global_batch, "d"),
             _fmt(r.samples_per_s, ".2f"), _fmt(r.samples_per_s_per_device, ".2f"),
             _mib(r.peak_memory_bytes),
             "ok" if r.stable else ("FAILED: " + r.error if r.error else
                                    f"NO ({r.skipped_updates} skipped or non-finite loss)"))
            for r in rows]
    return render_table(header, body, right=range(5))


def write_csv(rows: Sequence[BenchRow], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in rows:
            record = attrs.asdict(r)
            record["overrides"] = " ".join(r.overrides)
            writer.writerow(["" if record[c] is None else record[c] for c in CSV_COLUMNS])


def _child(argv: list[str]) -> int:
    """Inside the subprocess: train the recipe as ``octfw run RECIPE --set ...`` does,
    then write the device's own memory peak if it has one."""
    from octfw.engine.launch import launch
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    recipe_path, overrides = argv[0], argv[2::2]  # RECIPE --set k=v --set k=v ...
    registry = load_registry()
    try:
        summary = launch(load_recipe(recipe_path, overrides, registry), registry)
        code = 1 if summary.stopped else 0
    except UserError as exc:
        print(exc.console_text(), file=sys.stderr)  # as `octfw run` prints it
        code = exc.exit_code
    peak_file = os.environ.get(PEAK_FILE_ENV)
    if peak_file:
        peak = _device_peak()
        if peak is not None:
            Path(peak_file).write_text(json.dumps({"bytes": peak[0], "kind": peak[1]}))
    return code


def _device_peak() -> tuple[int, str] | None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "CUDA max_memory_allocated"
    if "torch_xla" in sys.modules:
        import torch_xla
        import torch_xla.core.xla_model as xm

        device = torch_xla.device()
        if xm.xla_device_hw(device) == "TPU":
            info = xm.get_memory_info(device)
            if "peak_bytes_used" in info:
                return int(info["peak_bytes_used"]), "TPU peak HBM"
    return None


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
