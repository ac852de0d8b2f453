"""What ``engine.parallelism = "fsdp"`` costs a step against ``"data"``, on N = 2 and 4 CPU processes.

Each case is a real ``octfw run --nproc-per-node N`` of the quickstart recipe (tiny model,
gloo, one torch thread per process), side by side in one invocation: ``data`` (DDP) and
``fsdp`` (FSDP2: every block's parameters gathered for its forward and backward, gradients
reduce-scattered) at the same global batch. Figure: the training loop's samples/s from
``summary.json``; the ratio is data / fsdp (how many times longer an fsdp step takes). Rounds
alternate the cases; medians are reported.

On the CPU the gathers are memory copies over gloo and the model is tiny, so the ratio is the
cost of the extra collectives where compute is smallest: an upper bound for a model large
enough to need sharding, whose blocks' compute hides the gathers on a GPU or TPU.

Usage: ``.venv/bin/python benchmarks/engine/sharding_cost.py [--rounds 3] [--steps 30]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py

from _common import ROOT, machine, write_result  # noqa: E402


def _run(nproc: int, parallelism: str, steps: int, out: Path) -> float:
    command = [sys.executable, "-m", "octfw.cli", "run", str(ROOT / "recipes" / "quickstart.toml"),
               "--nproc-per-node", str(nproc), "--set", f"run.output_dir={out}", "--set", f"run.max_steps={steps}",
               "--set", "engine.per_device_batch=2", "--set", f"engine.global_batch={2 * 4}",
               "--set", f"engine.parallelism={parallelism}", "--set", "engine.log_every_steps=10",
               "--set", 'logger=[{name="jsonl"}]', "--set", "run.export_encoder=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{parallelism} on {nproc}: exit {result.returncode}\n{result.stderr[-2000:]}")
    (run_dir,) = (out / "quickstart").iterdir()
    return json.loads((run_dir / "summary.json").read_text())["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for nproc in (2, 4):
                for parallelism in ("data", "fsdp"):
                    out = Path(tmp) / f"{round_}-{nproc}-{parallelism}"
                    rates.setdefault(f"{parallelism}, {nproc} processes", []).append(
                        _run(nproc, parallelism, args.steps, out))
    medians = {case: statistics.median(values) for case, values in rates.items()}
    ratios = {f"fsdp / data step time, {n} processes": medians[f"data, {n} processes"] / medians[f"fsdp, {n} processes"]
              for n in (2, 4)}
    for case, value in medians.items():
        print(f"{case:>22}: {value:8.2f} samples/s")
    for case, value in ratios.items():
        print(f"{case}: {value:.2f}x")
    write_result("sharding_cost", {"machine": machine(), "steps": args.steps, "rounds": args.rounds,
                                   "samples_per_s": rates, "median_samples_per_s": medians, "ratios": ratios})


if __name__ == "__main__":
    main()
