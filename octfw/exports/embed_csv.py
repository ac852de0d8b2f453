"""``octfw embed``: the pooled embedding of every usable volume at a location, as a CSV."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from octfw.display.errors import CorruptFile, UserError
from octfw.exports.pretrained import PretrainedEncoder
from octfw.exports.volumes import open_volumes
from octfw.registry import Registry
from octfw.storage.files import write_atomically
from octfw.display.tables import counted
from octfw.types import Sample

__all__ = ["embed_to_csv"]


def embed_to_csv(encoder: PretrainedEncoder, location: str | Path, out: str | Path, *,
                 registry: Registry, batch_size: int = 4,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """``octfw embed``: one CSV row per usable volume at ``location`` (source, domain, label,
    e0 ... e{E-1}: the pooled embedding), written atomically; a file that cannot be used is
    skipped and listed in ``<out>.quarantine.jsonl`` with the reason. Returns a summary."""
    import csv
    import io
    import json

    out = Path(out)
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist")
    dataset = open_volumes(location, registry)
    rows: list[list[Any]] = []
    quarantined: list[dict[str, str]] = []
    pending: list[tuple[Sample, np.ndarray]] = []

    def flush() -> None:
        pooled = encoder.encode_prepared([volume for _, volume in pending], pooled=True,
                                         batch_size=len(pending)).cpu().numpy()
        for (sample, _), vector in zip(pending, pooled):
            provenance = sample.provenance
            rows.append([provenance.source, provenance.domain,
                         "" if provenance.label is None else provenance.label, *map(float, vector)])
        pending.clear()

    for index in range(len(dataset)):
        try:
            sample = dataset.load(index)
            pending.append((sample, encoder.prepare(sample, registry)))
        except CorruptFile as bad:
            quarantined.append({"source": bad.url, "reason": bad.reason})
        if len(pending) == batch_size:
            flush()
        if progress is not None:
            progress(index + 1, len(dataset))
    if pending:
        flush()
    if not rows:
        raise UserError(f"{location}: none of its {counted(len(dataset), 'volume')} could be used"
                        + (f" (first: {quarantined[0]['source']}: {quarantined[0]['reason']})" if quarantined else ""))
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["source", "domain", "label", *(f"e{i}" for i in range(encoder.embed_dim))])
    writer.writerows(rows)
    write_atomically(str(out), text.getvalue().encode("utf-8"))
    quarantine_file = out.with_name(out.name + ".quarantine.jsonl")
    if quarantined:
        write_atomically(str(quarantine_file), "".join(json.dumps(q) + "\n" for q in quarantined).encode("utf-8"))
    return {"out": str(out), "volumes": len(rows), "quarantined": len(quarantined),
            "quarantine_file": str(quarantine_file) if quarantined else None, "embed_dim": encoder.embed_dim}
