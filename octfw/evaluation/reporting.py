"""What every ``octfw eval`` report shares: intervals and differences as cells and columns, and
what the test split held.

A report a user can cite says, beside each number, what it was measured on (the test split's
volumes and patients), how much it would move with other test patients (its bootstrap
interval) and what pretraining bought over random initialisation (the difference, with a
paired interval where the evaluator keeps its test predictions, else the plain difference).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from octfw.display.tables import counted

__all__ = ["INTERVAL_LEGEND", "DIFFERENCE_LEGEND", "interval_keys", "is_interval_key", "with_interval",
           "format_value", "format_difference", "plain_differences", "summarise_test_split", "format_test_split",
           "boundary_legend"]

#: The line under a table whose values carry a bootstrap interval.
INTERVAL_LEGEND = "[low, high]: bootstrap 95 % interval over test volumes (whole patients when known)"
#: ... and the line under the difference column's intervals.
DIFFERENCE_LEGEND = ("difference [low, high]: paired bootstrap 95 % interval (both encoders scored on the "
                     "same resamples); an interval above 0 is a gain")

CI_SUFFIXES = ("_ci_low", "_ci_high")


def interval_keys(key: str) -> tuple[str, str]:
    """The keys of ``key``'s bootstrap interval: ``auroc`` -> ``auroc_ci_low``, ``auroc_ci_high``
    (a per-domain ``auroc/topcon`` -> ``auroc_ci_low/topcon``, ...)."""
    metric, _, domain = key.partition("/")
    tail = f"/{domain}" if domain else ""
    return f"{metric}_ci_low{tail}", f"{metric}_ci_high{tail}"


def is_interval_key(key: str) -> bool:
    return key.partition("/")[0].endswith(CI_SUFFIXES)


def with_interval(scores: Mapping[str, float], key: str, column: str) -> dict[str, Any]:
    """``{column: value, column_ci_low: ..., column_ci_high: ...}`` of ``key`` ("" where missing)."""
    evaluator, _, metric = key.partition("/")
    low, high = interval_keys(metric)
    return {column: scores.get(key, ""), f"{column}_ci_low": scores.get(f"{evaluator}/{low}", ""),
            f"{column}_ci_high": scores.get(f"{evaluator}/{high}", "")}


def format_value(scores: Mapping[str, float], key: str) -> str:
    """``0.813`` or, with its bootstrap interval, ``0.813 [0.70, 0.91]``; ``-`` when missing."""
    return _with_interval(scores, key, sign="")


def format_difference(difference: Mapping[str, float], key: str) -> str:
    """``+0.125``, with its paired interval where there is one: ``+0.125 [+0.03, +0.22]``; ``-``
    when missing."""
    return _with_interval(difference, key, sign="+")


def _with_interval(scores: Mapping[str, float], key: str, sign: str) -> str:
    """``scores[key]`` to 3 decimals and its interval, where there is one, to 2 (``sign``: "+"
    shows the sign of every number, as a difference's)."""
    evaluator, _, metric = key.partition("/")
    value = scores.get(key)
    if value is None:
        return "-"
    low, high = (scores.get(f"{evaluator}/{k}") for k in interval_keys(metric))
    text = f"{value:{sign}.3f}"
    return text if low is None or high is None else f"{text} [{low:{sign}.2f}, {high:{sign}.2f}]"


def plain_differences(first: Mapping[str, float], second: Mapping[str, float],
                      paired: Mapping[str, float] | None = None) -> dict[str, float]:
    """``first`` minus ``second`` for every metric both report, then ``paired`` over it: the
    paired differences (equal values) with their intervals, where an evaluator gives them."""
    plain = {key: float(first[key]) - float(second[key]) for key in first
             if key in second and not is_interval_key(key.partition("/")[2])}
    return {**plain, **(paired or {})}


def _test_split(evaluator: Any) -> dict[str, Any] | None:
    split = getattr(evaluator, "split", None)
    if split is None:
        return None
    test = split()[1]
    groups = getattr(test, "groups", None)
    summary: dict[str, Any] = {"volumes": len(test.labels), "patients": None if groups is None else len(set(groups))}
    notes = getattr(evaluator, "describe_test_split", None)
    return {**summary, **(notes() if notes is not None else {})}


def summarise_test_split(evaluators: Sequence[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{evaluator: {"volumes": N, "patients": P or None, ...}}``: what each evaluator measured
    on (its split is made by then). ``patients`` is None where the dataset knows no patients (each
    volume is then resampled alone); an evaluator without ``split()`` is left out. An evaluator's
    ``describe_test_split()`` adds its own entries (layer segmentation: the row spacing per vendor)."""
    out = {}
    for name, evaluator in evaluators:
        summary = _test_split(evaluator)
        if summary is not None:
            out[name] = summary
    return out


def format_test_split(summary: Mapping[str, Mapping[str, Any]], names: Sequence[str], width: int = 8) -> str:
    """``test      knn: 12 volumes of 6 patients; dense-probe: ...`` for every evaluator in ``names``,
    its label padded to ``width`` as the report's other header lines."""
    parts = []
    for name in names:
        split = summary.get(name)
        if split is None:
            parts.append(f"{name}: not known (the evaluator shows no split)")
            continue
        volumes, patients = counted(split["volumes"], "volume"), split["patients"]
        parts.append(f"{name}: {volumes}, patients not known (each volume resampled alone)" if patients is None
                     else f"{name}: {volumes} of {counted(patients, 'patient')}")
    return f"{'test'.ljust(width)}  " + "; ".join(parts)


def boundary_legend(summary: Mapping[str, Mapping[str, Any]], metrics: Sequence[str]) -> list[str]:
    """The lines under a table that shows boundary errors: the row spacing each vendor's error in µm
    rests on, or that it is given in rows only where the dataset gives no spacing."""
    lines = []
    for name, split in summary.items():
        spacing = split.get("row_spacing_um")
        if spacing is None or not any(m.startswith(f"{name}/boundary_error") for m in metrics):
            continue
        known = {domain: value for domain, value in spacing.items() if value is not None}
        unknown = [domain for domain, value in spacing.items() if value is None]
        text = f"{name}: boundary_error_um counts rows of the prepared volume times their spacing"
        if known:
            text += ": " + ", ".join(f"{value:.2f} µm ({domain})" for domain, value in known.items())
        if unknown:
            text += f"; {', '.join(unknown)}: no axial spacing given, so in rows only (boundary_error_rows)"
        lines.append(text + "; boundary_error_rows is the same in rows")
    return lines
