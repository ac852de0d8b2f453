"""Engine overhead: octfw's update step (the real Trainer) against a hand-written
PyTorch loop, same model, batches, AdamW and device, in one process.

Four pairs are measured, each side in alternating blocks of ``--block``
update steps (one log step per block) so that machine noise hits both alike.
In the first three the hand loop uses the optimizer the engine builds
(torch's multi-tensor AdamW on the CPU, octfw's GatedAdamW on torch_xla), so
they measure the engine's own code:

- ``bare``: octfw without guards against the hand loop without clipping;
- ``guarded``: octfw with nan-skip + grad-clip against the hand loop with
  ``clip_grad_norm_`` and no skip (octfw's device-side skip is part of what
  its figure pays for);
- ``guarded-vs-host-skip``: the same octfw against a hand loop that also
  skips non-finite updates, the way one writes it by hand: reading the loss
  and gradient norm on the host every update.
- ``guarded-vs-torch-adamw``: the same octfw against the hand loop of
  ``guarded`` written with ``torch.optim.AdamW`` and torch's defaults for the
  device, what one gets without octfw.

Devices: the CPU (eager), and torch_xla on the CPU in a subprocess
(``--device xla`` runs that side alone). Data loading is excluded: both sides
cycle through the same batches, built once and already on the device.
Prints one line per figure and writes ``benchmarks/results/engine_overhead.json``.

    PJRT_DEVICE=CPU python benchmarks/engine/engine_overhead.py [--rounds 15] [--block 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, HandLoop, alternate, make_trainer, median, octfw_step, publish, xla_side  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart.toml"
GUARDED = 'guard=[{name="nan-skip"},{name="grad-clip",max_norm=1.0}]'
TARGET = 1.02  # octfw at most 2 % slower


#: pair -> (octfw's guards, the hand loop's clip, whether it skips on the host, its optimizer)
PAIRS = {"bare": ("guard=[]", None, False, "octfw"), "guarded": (GUARDED, 1.0, False, "octfw"),
         "guarded-vs-host-skip": (GUARDED, 1.0, True, "octfw"),
         "guarded-vs-torch-adamw": (GUARDED, 1.0, False, "torch")}


def measure(device: str, rounds: int, block: int, overrides: list[str], pairs: list[str]) -> dict:
    import torch

    figures = {}
    for pair in pairs:
        guards, clip, skip_on_host, optimizer = PAIRS[pair]
        trainer, batches = make_trainer(RECIPE, [f"run.device={device}", f"engine.log_every_steps={block}",
                                                 guards, *overrides])
        hand = HandLoop(trainer, batches, clip, skip_on_host, optimizer)
        times = alternate({"octfw": lambda s, log: octfw_step(trainer, s, log), "hand": hand.step},
                          rounds=rounds, block=block, log_every=block, sync=trainer.backend.synchronize)
        octfw_s, hand_s = median(times["octfw"]), median(times["hand"])
        # Blocks of one round ran back to back: their ratio cancels most of the machine's drift.
        paired = median([o / h for o, h in zip(times["octfw"], times["hand"])])
        figures[pair] = {"octfw_step_s": octfw_s, "hand_step_s": hand_s, "ratio": paired,
                         "ratio_of_medians": octfw_s / hand_s,
                         "ratio_of_best": min(times["octfw"]) / min(times["hand"]),
                         "octfw_blocks_s": times["octfw"], "hand_blocks_s": times["hand"]}
    recipe = trainer.recipe
    return {"device": device, "threads": torch.get_num_threads(), "rounds": rounds, "block": block,
            "per_device_batch": recipe.engine.per_device_batch, "grad_accum_steps": recipe.engine.grad_accum_steps,
            "image_size": list(recipe.transform.config.image_size), "model": recipe.model.config.preset,
            "figures": figures}


def report(result: dict) -> None:
    for pair, f in result["figures"].items():
        verdict = "within" if f["ratio"] <= TARGET else "ABOVE"
        print(f"engine overhead [{result['device']}, {pair}]: octfw {f['octfw_step_s'] * 1e3:.1f} ms/step, "
              f"hand-written {f['hand_step_s'] * 1e3:.1f} ms/step (medians), ratio {f['ratio']:.3f} "
              f"(median of paired blocks; best-of ratio {f['ratio_of_best']:.3f}; {verdict} the 1.02 target)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["both", "cpu", "xla"], default="both")
    parser.add_argument("--pair", choices=list(PAIRS), action="append",
                        help="pairs to measure (default: all)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--set", action="append", default=["engine.grad_accum_steps=2"],
                        help="recipe override for both sides (default engine.grad_accum_steps=2)")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    pairs = args.pair or list(PAIRS)
    results = []
    if args.device in ("both", "cpu"):
        results.append(measure("cpu", args.rounds, args.block, args.set, pairs))
    if args.device == "xla":
        results.append(measure("xla", args.rounds, args.block, args.set, pairs))
    if args.device == "both":
        # torch_xla patches torch process-wide: its own process, and one per pair,
        # since the XLA CPU JIT of more than two models exhausts the process's memory maps.
        xla = None
        for pair in pairs:
            sets = [arg for item in args.set for arg in ("--set", item)]
            result = xla_side(__file__, ["--pair", pair, "--rounds", str(args.rounds), "--block", str(args.block),
                                         *sets])[0]
            xla = result if xla is None else {**xla, "figures": {**xla["figures"], **result["figures"]}}
        results.append(xla)
    publish("engine_overhead", results, args.json_only, report)


if __name__ == "__main__":
    main()
