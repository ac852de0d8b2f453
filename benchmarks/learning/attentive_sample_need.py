"""How many labelled volumes the attentive probe needs to find a local finding (issue #39, item 4).

On 80 labelled volumes the attentive probe reads the held-out phantom cysts
from random ``tiny`` tokens at about 0.59 balanced accuracy, where the
linear probe on the same tokens reads 0.90 (``attentive_ceiling.py``: told
which 4 of the 64 tokens to read, the probe reaches 0.94, so what it lacks
is *where* to look). This asks whether a wider grid or more labelled
volumes close the gap: the held-out cysts cohort at several sizes (cohort
seed 1, half of the patients test, a quarter of the rest validation, as the
evaluator draws them), each read two ways on the same split:

- ``attentive``: what ``attentive-probe`` reports with its default grid
  (member and epoch chosen on the validation part, measured on test);
- ``linear_tokens``: the linear probe on all tokens (fit and validation
  parts together, as ``linear-probe`` trains).

Prints balanced accuracy per cohort size and split and writes
``benchmarks/results/attentive_sample_need.json``. One torch thread; the
2,000-volume cohort takes about 10 minutes per split on one core.

    PJRT_DEVICE=CPU OMP_NUM_THREADS=1 python benchmarks/learning/attentive_sample_need.py --volumes 200 500 1000 2000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import attentive_probe_parts, default_attentive_grid, machine, random_quickstart_encoder, write_result  # noqa: E402


def main() -> None:
    import numpy as np
    import torch

    from octfw.plugins.evaluators.attentive_probe.algorithm import (fit_attentive_grid, select_member,
                                                                     validation_scores)
    from octfw.plugins.evaluators.linear_probe.algorithm import fit_linear_probe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volumes", type=int, nargs="+", default=[200, 500, 1000, 2000], help="cohort sizes")
    parser.add_argument("--splits", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    registry, ctx, model = random_quickstart_encoder()
    grid_options = default_attentive_grid()

    def balanced(logits: torch.Tensor, targets: torch.Tensor) -> float:
        return validation_scores(logits[None], targets)[0][0]

    records = []
    for volumes in args.volumes:
        dataset = {"name": "phantom-oct", "family": "held-out", "n_volumes": volumes, "labels": True, "seed": 1}
        for split_seed in range(args.splits):
            start = time.perf_counter()
            p = attentive_probe_parts(registry, ctx, model, dataset, split_seed)
            grid = fit_attentive_grid(p["fit"], p["fit_y"], p["val"], p["val_y"], 2, **grid_options)
            chosen = select_member(grid, p["val"], p["val_y"]).chosen
            linear = fit_linear_probe(torch.cat([p["fit"], p["val"]]).flatten(1),
                                      torch.cat([p["fit_y"], p["val_y"]]), 2)
            record = {"volumes": volumes, "split_seed": split_seed, "fit_volumes": len(p["fit"]),
                      "validation_volumes": len(p["val"]), "test_volumes": len(p["test"]),
                      "attentive": balanced(grid.logits(p["test"])[chosen], p["test_y"]),
                      "attentive_member": list(grid.members[chosen]),
                      "attentive_epoch": [grid.best_epoch[chosen], grid.epochs_trained],
                      "linear_tokens": balanced(linear.probabilities(p["test"].flatten(1)).log(), p["test_y"]),
                      "seconds": time.perf_counter() - start}
            records.append(record)
            print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()),
                  flush=True)
    summary = []
    print(f"{'volumes':>8} {'fit':>5} {'attentive':>16} {'linear tokens':>16} {'gap':>7}")
    for volumes in args.volumes:
        rows = [r for r in records if r["volumes"] == volumes]
        line = {"volumes": volumes, "fit_volumes": rows[0]["fit_volumes"]}
        for key in ("attentive", "linear_tokens"):
            values = [r[key] for r in rows]
            line[key] = [float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0]
        line["gap"] = line["linear_tokens"][0] - line["attentive"][0]
        summary.append(line)
        print(f"{volumes:>8} {line['fit_volumes']:>5} {line['attentive'][0]:>9.3f} ± {line['attentive'][1]:.3f}"
              f" {line['linear_tokens'][0]:>9.3f} ± {line['linear_tokens'][1]:.3f} {line['gap']:>7.3f}")
    path = write_result("attentive_sample_need", {"family": "held-out", "cohort_seed": 1,
                                                  "encoder": "tiny, random init (seed 0)", "splits": args.splits,
                                                  "grid": grid_options, "machine": machine(),
                                                  "summary": summary, "records": records})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
