"""From dataset to batches: epoch-seeded order, per-sample RNG, quarantine, collate.

Every sample's randomness comes from ``(seed, epoch, index)``, so a batch does
not depend on worker count or timing and can be rebuilt later. A file the
dataset cannot use is quarantined and replaced by the next usable sample in
the same epoch order; no good file is dropped, and training never stops for
one bad file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from octfw.errors import ContractError, CorruptFile, UserError
from octfw.types import BATCH_KEYS, Dataset, Provenance, Transform

__all__ = ["EpochOrder", "SampleSource", "collate", "make_loader", "Quarantine"]


class EpochOrder(torch.utils.data.Sampler):
    """An endless stream of ``(epoch, index)``: a fresh permutation per epoch.

    ``start`` skips that many samples, so a resumed run continues exactly
    where the checkpoint left off. With several processes each takes every
    ``world_size``-th sample.
    """

    def __init__(self, size: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1):
        self.size, self.seed, self.start = size, seed, start
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = self.start * self.world_size + self.rank
        while True:
            epoch, offset = divmod(position, self.size)
            order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            yield epoch, int(order[offset])
            position += self.world_size


class SampleSource(torch.utils.data.Dataset):
    """Loads and transforms one ``(epoch, index)``; quarantines unusable files."""

    def __init__(self, dataset: Dataset, transform: Transform, seed: int):
        self.dataset, self.transform, self.seed = dataset, transform, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, index = key
        skipped: list[tuple[str, str]] = []
        for attempt in range(len(self.dataset)):
            candidate = (index + attempt) % len(self.dataset)
            rng = np.random.default_rng([self.seed, epoch, candidate])
            try:
                sample = self.dataset.load(candidate)
                arrays = self.transform(sample, rng)
            except CorruptFile as bad:  # from decoding, or from a transform that cannot use it
                skipped.append((bad.url, bad.reason))
                continue
            return {"arrays": arrays, "provenance": sample.provenance, "quarantined": skipped}
        raise UserError(
            f"no usable file in the dataset: all {len(self.dataset)} files failed to load "
            f"(first: {skipped[0][0]}: {skipped[0][1]})"
        )


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack arrays into tensors; keep provenance and quarantine records on the host."""
    tensors = {}
    for key in BATCH_KEYS:
        try:
            tensors[key] = torch.from_numpy(np.stack([item["arrays"][key] for item in items]))
        except KeyError:
            raise ContractError(f"transform output lacks {key!r}; it must return {', '.join(BATCH_KEYS)}") from None
        except ValueError as exc:
            shapes = [tuple(np.shape(item["arrays"][key])) for item in items]
            raise ContractError(f"transform output {key!r} has different shapes across samples {shapes}: {exc}") from None
    return {
        "tensors": tensors,
        "provenance": [item["provenance"] for item in items],
        "quarantined": [q for item in items for q in item["quarantined"]],
    }


def make_loader(source: SampleSource, batch_size: int, seed: int, start: int,
                num_workers: int, rank: int = 0, world_size: int = 1) -> torch.utils.data.DataLoader:
    order = EpochOrder(len(source), seed, start=start, rank=rank, world_size=world_size)
    return torch.utils.data.DataLoader(
        source,
        batch_size=batch_size,
        sampler=order,
        collate_fn=collate,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        drop_last=True,
    )


class Quarantine:
    """Unusable files, each recorded once, in ``quarantine.jsonl`` of the run directory."""

    def __init__(self, run_dir: Path | None):
        self.path = run_dir / "quarantine.jsonl" if run_dir is not None else None
        self.seen: dict[str, str] = {}

    def record(self, entries: list[tuple[str, str]]) -> None:
        new = [(url, reason) for url, reason in entries if url not in self.seen]
        for url, reason in new:
            self.seen[url] = reason
        if new and self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                for url, reason in new:
                    f.write(json.dumps({"url": url, "reason": reason}) + "\n")

    def __len__(self) -> int:
        return len(self.seen)


def provenance_record(provenance: Provenance) -> dict[str, Any]:
    return {"source": provenance.source, "domain": provenance.domain}
