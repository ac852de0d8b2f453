"""What a checkpoint save of an ``fsdp`` run costs the training loop: every process writing its own
slices (``step_N.dcp``, this release) beside the whole state gathered to be written as one file by
rank 0 (``step_N.pt``, the release before), on 2 CPU processes, side by side in one run.

Each process builds the real trainer of the quickstart recipe with ``model.preset`` (``base`` by
default: 190M parameters with its predictor and EMA encoder) and ``engine.parallelism = "fsdp"``,
trains two update steps (so AdamW holds its moments), then times, alternating, round after round:

- **stall**: what ``Trainer.save_checkpoint`` spends on the training thread before training goes
  on. Gathered: the whole state copied to the host on every process (a collective); sliced: the
  job's one-flag agreement and each process's copy of its own slices;
- **write**: the background part, each path to its own folder: rank 0's ``torch.save`` of the whole
  state, or every process writing its slices and rank 0 its pointer.

Medians over the rounds; the ratios are gathered / sliced. One torch thread per process.

Usage: ``.venv/bin/python benchmarks/engine/save_stall.py [--preset base] [--rounds 3]``
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py

from _common import ROOT, machine, write_result  # noqa: E402


def _worker(preset: str, rounds: int, out: Path) -> None:
    """One process of the job (under torchrun): the measurements, rank 0's printed as JSON."""
    import torch

    from octfw.engine.distributed import join
    from octfw.engine.plan import planned_run
    from octfw.engine.trainer import Trainer
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.storage.checkpoints import CheckpointStorage

    torch.set_num_threads(1)
    registry = load_registry()
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml", [
        f"run.output_dir={json.dumps(str(out / 'runs'))}", f"model.preset={json.dumps(preset)}",
        'engine.parallelism="fsdp"', "engine.per_device_batch=1", "engine.global_batch=2",
        "run.export_encoder=false"], registry)
    processes, peers = join("cpu", recipe.engine.collective_timeout_s)
    with planned_run(recipe, registry, resume=None, processes=processes, peers=peers) as plan:
        trainer = Trainer(plan, registry, peers=peers)
        for step in (0, 1):
            trainer.update(step)
        group = trainer.sharded_saves.group
        times: dict[str, list[float]] = {}
        for round_ in range(rounds):
            for path in ("gathered", "sliced"):
                peers.barrier()
                started = time.perf_counter()
                if path == "gathered":
                    state = trainer.state.whole(2)
                else:
                    peers.all_agree(True)  # what save_checkpoint asks the job before a sliced save
                    shards, plain = trainer.state.slices(2)
                stalled = time.perf_counter() - started
                storage = CheckpointStorage(str(out / f"{path}-{round_}"), keep_last=1)
                peers.barrier()
                started = time.perf_counter()
                if path == "gathered":
                    if processes.is_main:
                        storage.save(2, state)
                else:
                    storage.save_sharded(2, shards, plain, group)
                peers.barrier()  # the write ends when the slowest process's part is written
                written = time.perf_counter() - started
                times.setdefault(f"{path} stall", []).append(stalled)
                times.setdefault(f"{path} write", []).append(written)
        if processes.is_main:
            from octfw.engine.checkpointing import state_nbytes

            times["state GB"] = [state_nbytes(trainer.state.whole(2)) / 1e9]
            print("RESULT " + json.dumps(times), flush=True)
        else:
            trainer.state.whole(2)  # the gather is a collective
    peers.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.preset, args.rounds, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   __file__, "--worker", "--preset", args.preset, "--rounds", str(args.rounds), "--out", tmp]
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"exit {result.returncode}\n{result.stderr[-3000:]}")
    times = json.loads(lines[0][len("RESULT "):])
    medians = {case: statistics.median(values) for case, values in times.items()}
    state_gb = medians.pop("state GB")
    report = [f"save of an fsdp run, preset {args.preset} ({state_gb:.2f} GB of state), 2 CPU processes, "
              f"medians of {args.rounds} rounds:"]
    report += [f"  {case:16s} {seconds:8.3f} s" for case, seconds in medians.items()]
    report.append(f"  stall ratio (gathered / sliced): {medians['gathered stall'] / medians['sliced stall']:.1f}x")
    report.append(f"  write ratio (gathered / sliced): {medians['gathered write'] / medians['sliced write']:.2f}x")
    print("\n".join(report))
    write_result("save_stall", {"machine": machine(), "preset": args.preset, "rounds": args.rounds,
                                "seconds": times, "medians": medians})


if __name__ == "__main__":
    main()
