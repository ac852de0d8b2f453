"""The model card of an export (``README.md`` of a Hub folder, ``docs/README.md`` of a MONAI
bundle): what the encoder is, where it comes from, how to use it, and the run's evaluator
results, with the YAML metadata the Hub reads."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from octfw.exports.formats import DEFAULT_LICENSE

__all__ = ["model_card"]


def model_card(info: Mapping[str, Any], parameters: int) -> str:
    """``README.md`` of a Hub folder: what the encoder is, where it comes from, how to use it."""
    config, transform = info["config"], dict(info.get("transform") or {})
    model = dict(info.get("model") or {})
    grid = [s // p for s, p in zip(config["image_size"], config["patch_size"])]
    tokens = grid[0] * grid[1] * grid[2]
    title = f"{model.get('name', 'octfw')} 3D OCT encoder"
    source = f"checkpoint `{info.get('checkpoint', '')}`" + (f" of run `{info['run']}`" if info.get("run") else "")
    lines = [
        *_front_matter(info, title),
        "",
        f"# {title}",
        "",
        f"A ViT3D encoder ({parameters:,} parameters: embed_dim {config['embed_dim']}, depth {config['depth']}, "
        f"{config['num_heads']} heads) pretrained with octfw {info.get('octfw_version', '')} "
        f"for {info.get('update_step', 0):,} update steps ({source}) "
        f"on {', '.join(info.get('datasets') or ['unrecorded data'])}.",
        "",
        f"Licence: `{info.get('license') or DEFAULT_LICENSE}`"
        + (" (not stated at export: the pretraining data's terms decide)"
           if (info.get("license") or DEFAULT_LICENSE) == DEFAULT_LICENSE else "") + ".",
        "",
        f"Input: `[B, {config['in_channels']}, {', '.join(map(str, config['image_size']))}]` (B, C, D, H, W), "
        f"prepared by the `[transform]` below. Output: {tokens} patch tokens `[B, {tokens}, {config['embed_dim']}]` "
        f"in row-major order over the {'x'.join(map(str, grid))} patch grid; their mean is the volume's embedding.",
        "",
        "```python",
        "from octfw.exports.pretrained import PretrainedEncoder",
        "encoder = PretrainedEncoder.from_pretrained(\"path/or/org-name\")",
        "tokens = encoder.embed(\"scan.dcm\")                      # prepared as in training",
        "embedding = encoder.embed(volume, spacing=(dz, dy, dx), pooled=True)  # a [D, H, W] array, mm",
        "```",
        "",
        "Without octfw, the weights load with `safetensors.torch.load_file(\"model.safetensors\")`; "
        "`config.json` holds the architecture (`config`) and the preparation (`transform`).",
        "",
        "## Preparation (`[transform]` of the pretraining recipe)",
        "",
        "```json",
        json.dumps(transform, indent=2, default=str),
        "```",
        "",
        *_metrics_section(info.get("metrics") or []),
    ]
    return "\n".join(lines)


def _metrics_section(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The evaluator results as a table, or a sentence saying there are none."""
    if not results:
        return ["## Evaluation", "", "No evaluator results were recorded with this export.", ""]
    rows = [f"| {r['evaluator']} | {r['metric']} | {float(r['value']):.4f} | {r.get('dataset') or ''} | {r['step']} |"
            for r in results]
    return ["## Evaluation (the run's evaluators, on frozen features)", "",
            "| evaluator | metric | value | dataset | update step |", "|---|---|---|---|---|", *rows, ""]


def _front_matter(info: Mapping[str, Any], title: str) -> list[str]:
    """The model card's YAML metadata as the Hub reads it: licence, datasets, and the
    evaluator results as ``metrics`` and ``model-index``. Strings and numbers are written
    as JSON, which YAML reads unchanged."""
    q = json.dumps
    lines = ["---", "library_name: octfw", "pipeline_tag: feature-extraction",
             f"license: {q(info.get('license') or DEFAULT_LICENSE)}",
             "tags: [octfw, oct, 3d, self-supervised, vit]"]
    datasets = [str(d) for d in info.get("datasets") or []]
    if datasets:
        lines += ["datasets:", *(f"- {q(d)}" for d in datasets)]
    results = list(info.get("metrics") or [])
    if results:
        lines += ["metrics:", *(f"- {q(m)}" for m in dict.fromkeys(str(r["metric"]) for r in results))]
        lines += ["model-index:", f"- name: {q(title)}", "  results:"]
        # One result per evaluator and its dataset, with each of its metrics.
        groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for r in results:
            groups.setdefault((str(r["evaluator"]), str(r.get("dataset") or "unknown")), []).append(r)
        for (evaluator, dataset), group in groups.items():
            lines += ["  - task:", "      type: feature-extraction",
                      f"      name: {q(evaluator + ' on frozen features')}",
                      "    dataset:", f"      name: {q(dataset)}", f"      type: {q(dataset)}", "    metrics:"]
            for r in group:
                lines += [f"    - type: {q(str(r['metric']))}", f"      value: {q(float(r['value']))}",
                          f"      name: {q(evaluator + '/' + str(r['metric']))}"]
    return [*lines, "---"]
