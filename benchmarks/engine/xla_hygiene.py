"""XLA graph hygiene: compilations and device-to-host transfers per update step
of the real engine on torch_xla (the CPU device here, a TPU where present),
over 200 update steps with gradient accumulation 2, three guards
(nan-skip, grad-clip, lr-positive), EMA and logging every 10 steps.

Targets: 0 compilations after warm-up; transfers only on log steps. The
counting is octfw.diagnostics.xla_counters, shared with the hygiene test
(tests/test_xla_engine.py), run in a subprocess (torch_xla patches torch).
Prints one line per figure and writes ``benchmarks/results/xla_hygiene.json``.

    PJRT_DEVICE=CPU python benchmarks/engine/xla_hygiene.py [--steps 200] [--log-every 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, machine, run_subprocess, write_result  # noqa: E402

from octfw.diagnostics.xla_counters import HYGIENE_OVERRIDES, summarize

RECIPE = ROOT / "recipes" / "quickstart.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "quickstart.toml"
        # The quickstart, writing its runs into the temporary folder.
        text = RECIPE.read_text().replace('output_dir = "../runs"', f'output_dir = "{tmp}/runs"')
        text = text.replace("epochs = 5", "epochs = 100000")  # run.max_steps decides
        recipe.write_text(text)
        out = run_subprocess([sys.executable, "-m", "octfw.diagnostics.xla_counters", str(recipe),
                              str(args.steps), str(args.log_every)], env={"PJRT_DEVICE": "CPU"})
    raw = json.loads(out.strip().splitlines()[-1])
    s = summarize(raw)
    steady = s["update_steps"] - s["warm_up_steps"] - 1
    print(f"xla compilations: {s['compiles_in_warm_up']} in the first {s['warm_up_steps']} update steps (warm-up), "
          f"{s['compiles_after_warm_up']} in the {steady} after ({s['compiles_per_step_after_warm_up']:.3f} per step; "
          f"target 0); {s['end_of_run_compiles']} in the last step, which also ends the run (final checkpoint, summary)")
    print(f"xla device-to-host transfers: {s['transfers_per_log_step']:.1f} per log step, "
          f"{s['transfers_per_non_log_step']:.3f} per non-log step ({s['non_log_steps_with_transfers']} non-log "
          "steps moved anything; target 0)")
    print(f"xla .item() calls in the loop: {s['item_calls_in_loop']}; parallel device loaders: {s['mp_device_loaders']}")
    path = write_result("xla_hygiene", {"machine": machine(), "settings": {
        "steps": args.steps, "log_every": args.log_every, "overrides": list(HYGIENE_OVERRIDES),
        "recipe": "recipes/quickstart.toml"}, "summary": s, "rows": raw["rows"], "end": raw["end"]})
    print(f"written {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
