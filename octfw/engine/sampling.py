"""The order samples are drawn in: an endless, epoch-seeded stream of ``(epoch, index)``.

Each epoch's order is a function of ``(seed, epoch)`` only, so every process
computes the same one and a resumed run continues exactly where its
checkpoint left off.

Domains: ``natural`` order draws every file once per epoch; ``balanced``
draws the same number of samples from every domain each epoch
(:class:`BalancedEpochOrder`), repeating files of small domains and
spreading those of large ones over epochs.

Several processes (the hosts of a TPU slice, or torchrun ranks) share one
stream of samples: process ``r`` of ``W`` takes every ``W``-th position from
``r`` on, so together they draw each epoch exactly once and a step's global
batch holds the same samples whatever ``W`` is (:class:`EpochOrder`);
:func:`share_report` says in one line which samples a process takes.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np
import torch

from octfw.display.errors import UserError
from octfw.display.tables import counted

__all__ = ["DOMAIN_SAMPLING", "EpochOrder", "BalancedEpochOrder", "share_report"]

#: Values of ``[engine] domain_sampling``.
DOMAIN_SAMPLING = ("natural", "balanced")


class EpochOrder(torch.utils.data.Sampler):
    """An endless stream of ``(epoch, index)``: a fresh permutation per epoch.

    Position ``p`` of the stream is sample ``p % N`` of epoch ``p // N``'s
    order: epochs follow each other with nothing dropped, so a batch may
    straddle two epochs. ``start`` is the stream position to begin at (the
    samples all processes have consumed), so a resumed run continues exactly
    where the checkpoint left off.

    With several processes, process ``rank`` takes positions ``start + rank``,
    ``start + rank + world_size``, ...: over ``k`` samples each, the processes
    together take exactly the positions ``start .. start + k * world_size``,
    the same samples one process would take alone. So every epoch is drawn
    exactly once in total, and which samples form a step's global batch does
    not depend on how many processes load it.
    """

    def __init__(self, size: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1):
        self.size, self.seed, self.start = size, seed, start
        self.rank, self.world_size = rank, world_size
        self._epochs: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch``, in the order they are drawn."""
        if epoch not in self._epochs:
            self._epochs = {epoch: self._order(epoch)}  # one epoch at a time is all a stream needs
        return self._epochs[epoch]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = self.start + self.rank
        while True:
            epoch, offset = divmod(position, self.size)
            yield epoch, int(self.epoch_order(epoch)[offset])
            position += self.world_size


class BalancedEpochOrder(EpochOrder):
    """Like :class:`EpochOrder`, but every domain gets an equal share of each epoch.

    An epoch keeps the dataset's length ``N`` (so steps per epoch do not
    change). Each of the ``K`` domains gets ``N // K`` draws; the ``N % K``
    left over go to domains chosen at random per epoch. A domain's draws walk
    through its files in a fresh permutation per pass, continuing across
    epochs, so a large domain is covered over several epochs without
    repeats and a small one repeats evenly. Everything is a function of
    ``(seed, epoch)``, so every process computes the same epoch order;
    positions, ``start``, ``rank`` and ``world_size`` work exactly as in
    :class:`EpochOrder`, and the processes together draw each epoch's
    balanced order exactly once.
    """

    def __init__(self, domains: list[str], seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1):
        if not domains:
            raise UserError("balanced domain sampling needs a non-empty dataset")
        super().__init__(len(domains), seed, start=start, rank=rank, world_size=world_size)
        names = sorted(set(domains))
        self.members = [np.array([i for i, d in enumerate(domains) if d == name]) for name in names]

    def _counts(self, epoch: int) -> np.ndarray:
        k = len(self.members)
        counts = np.full(k, self.size // k)
        extra = np.random.default_rng([self.seed, epoch, 1]).permutation(k)[: self.size % k]
        counts[extra] += 1
        return counts

    def _draws(self, domain: int, first: int, count: int) -> list[int]:
        """Draws ``first .. first + count`` of one domain's endless stream of passes."""
        members = self.members[domain]
        out: list[int] = []
        position = first
        while len(out) < count:
            passes, offset = divmod(position, len(members))
            order = np.random.default_rng([self.seed, domain, passes, 2]).permutation(len(members))
            take = min(len(members) - offset, count - len(out))
            out.extend(int(i) for i in members[order[offset:offset + take]])
            position += take
        return out

    def _order(self, epoch: int) -> np.ndarray:
        consumed = np.zeros(len(self.members), dtype=np.int64)
        for earlier in range(epoch):
            consumed += self._counts(earlier)
        counts = self._counts(epoch)
        chosen = [i for d in range(len(self.members))
                  for i in self._draws(d, int(consumed[d]), int(counts[d]))]
        return np.array(chosen)[np.random.default_rng([self.seed, epoch, 3]).permutation(self.size)]


def share_report(order: EpochOrder, batch_size: int, shown: int = 4) -> str:
    """One line on what this process loads, e.g. ``host 1 of 4 loads 4 samples per
    micro-step: offsets 1, 5, 9, 13 of each global micro-batch of 16 stream positions,
    from position 0 (epoch 0); first dataset indices 12, 40, 3, 27``. Hosts that read
    different data show different first indices; they are computed, not loaded."""
    stride = order.world_size
    offsets = ", ".join(str(order.rank + stride * j) for j in range(min(batch_size, shown)))
    more = ", ..." if batch_size > shown else ""
    first = [index for _, index in itertools.islice(iter(order), shown)]
    return (f"host {order.rank} of {stride} loads {counted(batch_size, 'sample')} per micro-step: offsets "
            f"{offsets}{more} of each global micro-batch of {batch_size * stride} stream positions, "
            f"from position {order.start} (epoch {order.start // order.size}); first dataset "
            "indices " + ", ".join(map(str, first)))
