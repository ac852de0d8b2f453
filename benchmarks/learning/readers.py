"""Which reader sees a finding a few tokens hold? Issue #39, on the held-out phantom cysts.

A randomly initialised ``tiny`` encoder (the quickstart's architecture, seed
0: ``octfw eval``'s baseline) is read by every frozen reader on the held-out
phantom family's labelled task (200 volumes, 100 patients, cohort seed 1;
half the patients train) over ``--splits`` patient-level splits:

- ``linear-probe`` and ``knn`` (k = 10), each on the mean over the tokens
  (``balanced_accuracy``) and on the 64 tokens (``tokens_balanced_accuracy``);
- ``attentive-probe`` with its defaults (V-JEPA's attentive classifier, 18
  members, trained until validation stops improving);
- ``fine-tune`` (the whole encoder under the attentive head) on
  ``--shots`` volumes per class (one draw per split).

Prints balanced accuracy and AUROC (mean ± std over splits) and writes
``benchmarks/results/readers.json``.

    PJRT_DEVICE=CPU OMP_NUM_THREADS=1 python benchmarks/learning/readers.py --splits 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import machine, random_quickstart_encoder, write_result  # noqa: E402

DATASET = {"name": "phantom-oct", "family": "held-out", "n_volumes": 200, "labels": True, "seed": 1}
READINGS = (("linear-probe", ""), ("linear-probe", "tokens_"), ("knn", ""), ("knn", "tokens_"),
            ("attentive-probe", ""), ("fine-tune", ""))


def main() -> None:
    import numpy as np
    import torch

    from octfw.evaluation.shots import label_efficiency
    from octfw.recipe import build_component

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--shots", type=int, default=10, help="fine-tune's volumes per class")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = [f'run.cache_dir="{args.cache_dir}"'] if args.cache_dir else []
    registry, ctx, model = random_quickstart_encoder(overrides)
    options = {"knn": {"k": 10}}
    records: list[dict[str, Any]] = []
    for split_seed in range(args.splits):
        for name in dict.fromkeys(name for name, _ in READINGS):
            table = {"name": name, "dataset": DATASET, "split_seed": split_seed, "bootstrap": 0,
                     **options.get(name, {})}
            evaluator = build_component(registry, "evaluator", table, ctx, name)
            start = time.perf_counter()
            with torch.no_grad():
                encoded = evaluator.encode(model, torch.device("cpu"))
                if name == "fine-tune":
                    ((_, (scores,)),) = label_efficiency(evaluator, encoded, [args.shots], draws=1, seed=split_seed)
                else:
                    scores = evaluator.score(encoded)
            seconds = time.perf_counter() - start
            records.append({"split_seed": split_seed, "evaluator": name, "seconds": seconds,
                            **{k: float(v) for k, v in scores.items() if "/" not in k}})
            print(f"split {split_seed} {name}: {seconds:.0f} s", flush=True)
    summary = []
    for name, prefix in READINGS:
        rows = [r for r in records if r["evaluator"] == name]
        stats = {metric: [float(np.mean([r[prefix + metric] for r in rows])),
                          float(np.std([r[prefix + metric] for r in rows], ddof=1)) if len(rows) > 1 else 0.0]
                 for metric in ("balanced_accuracy", "auroc")}
        summary.append({"reader": f"{name} {prefix.rstrip('_') or ('mean' if name in ('linear-probe', 'knn') else '')}"
                        .strip(), **stats, "seconds": float(np.mean([r["seconds"] for r in rows]))})
        print(f"{summary[-1]['reader']:<24} balanced accuracy {stats['balanced_accuracy'][0]:.3f} ± "
              f"{stats['balanced_accuracy'][1]:.3f}   AUROC {stats['auroc'][0]:.3f} ± {stats['auroc'][1]:.3f}")
    path = write_result("readers", {"dataset": DATASET, "encoder": "tiny, random init (seed 0)",
                                    "splits": args.splits, "fine_tune_shots": args.shots, "machine": machine(),
                                    "summary": summary, "records": records})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
