"""Why the attentive probe falls short of the token linear probe on random tokens (issue #39, item 4).

The quickstart's ``tiny`` encoder, randomly initialised (seed 0, ``octfw
eval``'s baseline), on the held-out phantom cysts (200 volumes, cohort seed
1), over ``--splits`` patient-level splits. The attentive probe's tokens of
each split (fit, validation and test parts, as the evaluator draws them) are
read five ways, with the evaluator's default grid (18 members):

- ``validated``: what ``attentive-probe`` reports (member and epoch chosen
  on the validation part);
- ``ceiling``: the same grid with the *test* part choosing the member and
  the epoch (an upper bound, not a measurement);
- ``focus_validated`` / ``focus_ceiling``: the same, on only the ``--focus``
  tokens that single-token linear probes fitted on the fit part rank best on
  the validation part (the attention told where to look; the test part
  plays no part in the ranking);
- ``linear_tokens``: the linear probe on all tokens (the reading the issue
  calls the random tokens' ceiling);
- ``linear_mean_focus``: the linear probe on the mean of the focus tokens,
  after the probe's per-token layer norm (what attention pooling can keep
  when it looks at the right tokens).

Prints balanced accuracy per split and writes
``benchmarks/results/attentive_ceiling.json``.

    PJRT_DEVICE=CPU OMP_NUM_THREADS=1 python benchmarks/learning/attentive_ceiling.py --splits 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import attentive_probe_parts, default_attentive_grid, machine, random_quickstart_encoder, write_result  # noqa: E402

DATASET = {"name": "phantom-oct", "family": "held-out", "n_volumes": 200, "labels": True, "seed": 1}


def main() -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from octfw.plugins.evaluators.attentive_probe.algorithm import (fit_attentive_grid, select_member,
                                                                     validation_scores)
    from octfw.plugins.evaluators.linear_probe.algorithm import fit_linear_probe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--focus", type=int, default=4, help="tokens the focused readings keep")
    args = parser.parse_args()
    torch.set_num_threads(1)
    registry, ctx, model = random_quickstart_encoder()
    grid_options = default_attentive_grid()

    def balanced(probabilities: torch.Tensor, targets: torch.Tensor) -> float:
        return validation_scores(probabilities.log()[None], targets)[0][0]

    def attentive(fit, fit_y, val, val_y, test, test_y) -> tuple[float, float]:
        """(test score of the member validation chooses, best test score of any member and epoch)."""
        grid = fit_attentive_grid(fit, fit_y, val, val_y, 2, **grid_options)
        chosen = select_member(grid, val, val_y).chosen
        validated = balanced(grid.probabilities(test, chosen), test_y)
        ceiling = fit_attentive_grid(fit, fit_y, test, test_y, 2, **grid_options)
        return validated, max(validation_scores(ceiling.logits(test), test_y)[0])

    def linear(fit, fit_y, test, test_y) -> float:
        return balanced(fit_linear_probe(fit, fit_y, 2).probabilities(test), test_y)

    records = []
    for split_seed in range(args.splits):
        start = time.perf_counter()
        parts = attentive_probe_parts(registry, ctx, model, DATASET, split_seed)
        fit, fit_y, val, val_y = parts["fit"], parts["fit_y"], parts["val"], parts["val_y"]
        test_tokens, test_y = parts["test"], parts["test_y"]
        # Rank tokens by a single-token linear probe fitted on the fit part, scored on validation.
        per_token = [linear(fit[:, t], fit_y, val[:, t], val_y) for t in range(fit.shape[1])]
        focus = torch.tensor(np.argsort(per_token, kind="stable")[::-1][:args.focus].copy())
        validated, ceiling = attentive(fit, fit_y, val, val_y, test_tokens, test_y)
        focus_validated, focus_ceiling = attentive(fit[:, focus], fit_y, val[:, focus], val_y,
                                                   test_tokens[:, focus], test_y)
        train_all = torch.cat([fit, val])
        train_y = torch.cat([fit_y, val_y])

        def pooled(tokens: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(tokens[:, focus].float(), (tokens.shape[-1],)).mean(dim=1)

        record = {"split_seed": split_seed, "validated": validated, "ceiling": ceiling,
                  "focus_validated": focus_validated, "focus_ceiling": focus_ceiling,
                  "linear_tokens": linear(train_all.flatten(1), train_y, test_tokens.flatten(1), test_y),
                  "linear_mean_focus": linear(pooled(train_all), train_y, pooled(test_tokens), test_y),
                  "focus_tokens": focus.tolist(), "seconds": time.perf_counter() - start}
        records.append(record)
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()),
              flush=True)
    keys = ("validated", "ceiling", "focus_validated", "focus_ceiling", "linear_tokens", "linear_mean_focus")
    summary = {k: [float(np.mean([r[k] for r in records])), float(np.std([r[k] for r in records], ddof=1))
                   if len(records) > 1 else 0.0] for k in keys}
    for k, (mean, std) in summary.items():
        print(f"{k:<20} {mean:.3f} ± {std:.3f}")
    path = write_result("attentive_ceiling", {"dataset": DATASET, "encoder": "tiny, random init (seed 0)",
                                              "focus": args.focus, "splits": args.splits, "machine": machine(),
                                              "summary": summary, "records": records})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
