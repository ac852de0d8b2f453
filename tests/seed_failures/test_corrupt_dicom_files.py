"""Seed failure: Topcon and Zeiss exports held corrupt files (missing pixel
data, truncated, not DICOM): "~10-20% of files", each one a crash or a
silently dropped batch.

octfw's dataset raises ``CorruptFile`` for an unusable file; the engine skips
it, lists it once in ``quarantine.jsonl`` with the reason, counts it in
``summary.json`` and trains on. The files here are real broken DICOM files
written by the synthetic cohort."""

import json

from seedkit import train, write_tiny


def test_corrupt_files_are_skipped_listed_once_and_counted(tmp_path):
    recipe = write_tiny(tmp_path)
    summary, run_dir = train(recipe, ["dataset.n_volumes=10", "dataset.corrupt_fraction=0.4",
                                      "run.max_steps=6", "engine.per_device_batch=2"])
    assert summary.update_steps == 6 and summary.stopped is None
    quarantined = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    urls = [q["url"] for q in quarantined]
    assert len(urls) == len(set(urls)) == 4
    assert all(q["reason"] and q["url"].endswith(".dcm") for q in quarantined)
    assert len({q["reason"] for q in quarantined}) > 1  # several kinds of breakage, each named
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["quarantined"] == summary.quarantined == 4
