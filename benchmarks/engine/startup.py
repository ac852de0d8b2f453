"""Start-up: wall time of ``octfw list`` and ``octfw check recipes/quickstart.toml``
against ``python -c "import torch"``, each a fresh subprocess, median of
several repeats (interleaved, so machine noise hits all three alike).

``octfw list`` must not import torch, so it should cost a fraction of the
reference; ``check`` imports torch and builds and runs one batch.
Prints one line per figure and writes ``benchmarks/results/startup.json``.

    PJRT_DEVICE=CPU python benchmarks/engine/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, machine, write_result  # noqa: E402

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "octfw list": [sys.executable, "-m", "octfw.cli", "list"],
    "octfw check quickstart": [sys.executable, "-m", "octfw.cli", "check", "recipes/quickstart.toml"],
}


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for command in COMMANDS.values():  # warm the file cache and the synthetic cohort once
        timed(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, command in COMMANDS.items():
            times[name].append(timed(command))
    medians = {name: statistics.median(t) for name, t in times.items()}
    reference = medians["import torch"]
    for name, value in medians.items():
        print(f"startup [{name}]: {value:.2f} s median of {args.repeats} ({value / reference:.2f}x `import torch`)")
    path = write_result("startup", {"machine": machine(), "repeats": args.repeats, "median_s": medians,
                                    "ratio_to_import_torch": {n: v / reference for n, v in medians.items()},
                                    "times_s": times})
    print(f"written {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
