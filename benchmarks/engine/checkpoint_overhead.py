"""What checkpoints cost the training loop, and what a storage outage costs a run.

Each case is a real ``octfw run`` of the quickstart recipe in its own process
(40 update steps, tiny model, CPU), side by side in one invocation:

- ``none``: no checkpoint until the end;
- ``local``: a checkpoint every 2 update steps to the run folder;
- ``local, in the loop``: the same, each save awaited in the loop, as octfw
  saved before background saves (the baseline they replace);
- ``gcs``: a checkpoint every 2 update steps to a GCS emulator on 127.0.0.1,
  and ``gcs, in the loop`` the same awaited in the loop;
- ``gcs, store lost``: the same, with the emulator stopped after update step
  10, at the gcs checkpointer's default retry settings.

Figures: the training loop's samples/s (from ``summary.json``: the loop's
time, final save included) and each run's wall time. The ratios compare each
case with ``none`` (loop rate) and the lost store with ``gcs`` (wall time;
the target is at most 2x). Rounds alternate the cases; medians are reported.

On a 2-core machine the background writer competes with training for the
same cores (and the emulator is a Python server on them too); ``--threads 1``
gives training one core (``OMP_NUM_THREADS=1``), as an accelerator host has
cores to spare, to show what the overlap is worth there.

Usage: ``PJRT_DEVICE=CPU .venv/bin/python benchmarks/engine/checkpoint_overhead.py [--rounds 3] [--threads 1]``
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the GCS emulator helper

from _common import ROOT, machine, write_result  # noqa: E402
from gcs_emulator import GCSEmulator  # noqa: E402

STEPS = 40
BASE = ["--set", f"run.max_steps={STEPS}", "--set", "engine.log_every_steps=5",
        "--set", 'logger=[{name="jsonl"}]']


# `octfw run` with every background save awaited at once: the loop pays for the whole write.
IN_THE_LOOP = ("import sys; from octfw.engine.checkpointing import BackgroundSaver as S; submit = S.submit; "
               "S.submit = lambda self, *a: submit(self, *a) and self.wait(86400.0); "
               "from octfw.cli.main import main; sys.exit(main(sys.argv[1:]))")


def _run(args: list[str], env: dict[str, str], out: Path, stop_after_step: int | None = None,
         emulator: GCSEmulator | None = None, in_the_loop: bool = False) -> dict[str, float]:
    entry = ["-c", IN_THE_LOOP] if in_the_loop else ["-m", "octfw.cli"]
    command = [sys.executable, *entry, "run", str(ROOT / "recipes" / "quickstart.toml"),
               "--set", f"run.output_dir={out}", *BASE, *args]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if stop_after_step is not None:
        while process.poll() is None:
            metrics = list(out.glob("*/*/metrics.jsonl"))
            if metrics and any(json.loads(line)["step"] >= stop_after_step
                               for line in metrics[0].read_text().splitlines()):
                emulator.stop()
                break
            time.sleep(0.05)
    _, err = process.communicate()
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{err}")
    summary = json.loads(next(out.glob("*/*/summary.json")).read_text())
    return {"wall_s": wall, "loop_samples_per_s": summary["samples_per_s"], "loop_s": summary["elapsed_s"],
            "failed_saves": len(summary["failed_saves"]), "skipped_saves": summary["skipped_saves"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the training process (OMP_NUM_THREADS); default: torch's")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="octfw-ckpt-bench-"))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OCTFW_CACHE_DIR": str(scratch / "cache")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    emulator = GCSEmulator().start()
    env.update(emulator.env())
    emulator.make_bucket("bench")
    every2 = ["--set", "engine.checkpoint_every_steps=2"]
    cases = {
        "none": [],
        "local": every2,
        "local, in the loop": every2,
        "gcs": [],
        "gcs, in the loop": [],
    }
    _run([], env, scratch / "warmup")  # writes the cohort and fills the prepared-volume cache once
    results: dict[str, list[dict[str, float]]] = {name: [] for name in [*cases, "gcs, store lost"]}
    for round_ in range(args.rounds):
        for name, extra in cases.items():
            if name.startswith("gcs"):
                extra = [*every2, "--set", "checkpointer.name=gcs",
                         "--set", f"checkpointer.dir=gs://bench/{name[:3]}{round_}{len(name)}"]
            results[name].append(_run(extra, env, scratch / f"{name}-{round_}".replace(" ", ""),
                                      in_the_loop=name.endswith("in the loop")))
        # The store goes away after update step 10 and stays away: a fresh emulator per round.
        results["gcs, store lost"].append(_run(
            [*every2, "--set", "checkpointer.name=gcs", "--set", f"checkpointer.dir=gs://bench/lost{round_}"],
            env, scratch / f"lost-{round_}", stop_after_step=10, emulator=emulator))
        emulator = GCSEmulator().start()
        env.update(emulator.env())
        emulator.make_bucket("bench")
    emulator.stop()

    median = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
              for name, rows in results.items()}
    base_rate = median["none"]["loop_samples_per_s"]
    threads = f", OMP_NUM_THREADS={args.threads}" if args.threads else ""
    print(f"checkpoint overhead, quickstart {STEPS} update steps, median of {args.rounds} rounds{threads}")
    print(f"{'case':<20}{'loop samples/s':>16}{'vs none':>9}{'wall s':>9}{'failed':>8}{'skipped':>9}")
    for name, row in median.items():
        print(f"{name:<20}{row['loop_samples_per_s']:>16.1f}{row['loop_samples_per_s'] / base_rate:>9.3f}"
              f"{row['wall_s']:>9.1f}{row['failed_saves']:>8.0f}{row['skipped_saves']:>9.0f}")
    lost_ratio = median["gcs, store lost"]["wall_s"] / median["gcs"]["wall_s"]
    print(f"store lost after step 10 / store up (wall time): {lost_ratio:.2f}x (target <= 2x)")
    suffix = f"_threads{args.threads}" if args.threads else ""
    path = write_result(f"checkpoint_overhead{suffix}", {
        "machine": machine(), "steps": STEPS, "rounds": args.rounds, "threads": args.threads,
        "median": median, "runs": results,
        "store_lost_wall_ratio": lost_ratio,
    })
    print(f"written {path}")


if __name__ == "__main__":
    main()
