"""The checkpointer stage's contract: save, find and load the whole training state
(:class:`Checkpointer`), and the five optional capabilities the built-ins all have."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from octfw.types.capability import _CapabilityMeta

__all__ = [
    "Checkpointer", "ListingCheckpointer", "ClaimingCheckpointer", "CancellableCheckpointer",
    "LocatedCheckpointer", "ShardedCheckpointer",
]


@runtime_checkable
class Checkpointer(Protocol, metaclass=_CapabilityMeta):
    """Saves and restores the whole training state.

    ``save`` is atomic: a reader never sees a partial checkpoint, and
    ``latest`` never points at one. It raises on failure; the engine warns,
    keeps training and lists the failed save in the summary.
    ``load`` must refuse a damaged checkpoint, never load it.

    Optional, and the built-ins have them all: :class:`ListingCheckpointer`,
    :class:`ClaimingCheckpointer`, :class:`CancellableCheckpointer`,
    :class:`LocatedCheckpointer`, :class:`ShardedCheckpointer`.
    """

    def save(self, update_step: int, state: Mapping[str, Any]) -> str: ...

    def latest(self) -> str | None: ...

    def load(self, location: str) -> dict[str, Any]: ...


@runtime_checkable
class ListingCheckpointer(Checkpointer, Protocol):
    """Optional: ``checkpoints() -> [(update_step, location)]``, the complete checkpoints,
    so ``octfw replay`` and ``octfw eval --checkpoints`` can choose among them (else
    only ``latest()`` is known)."""

    def checkpoints(self) -> Sequence[tuple[int, str]]: ...


@runtime_checkable
class ClaimingCheckpointer(Checkpointer, Protocol):
    """Optional: one writer per folder.

    ``claim(needed_bytes)`` holds the folder for the run (rank 0, before
    training) and raises :class:`octfw.display.errors.UserError` when another
    process holds it or a checkpoint could not be written (no space, no
    permission, store unreachable); ``release()`` gives it up at the end.
    """

    def claim(self, needed_bytes: int) -> None: ...

    def release(self) -> None: ...


@runtime_checkable
class CancellableCheckpointer(Checkpointer, Protocol):
    """Optional: ``cancel()`` aborts the save in flight (from another thread) when the user
    asks to stop at once (a second Ctrl-C); the unfinished write must never be loaded."""

    def cancel(self) -> None: ...


@runtime_checkable
class LocatedCheckpointer(Checkpointer, Protocol):
    """Optional: ``location``, the folder or URL checkpoints go to, named in messages about
    a failed or slow save (and probed when a store seems unreachable); None where there is none
    (a rank that does not write)."""

    location: str | None


@runtime_checkable
class ShardedCheckpointer(Checkpointer, Protocol):
    """Optional: ``save_sharded``, a checkpoint every process of a sharded run
    (``engine.parallelism = "fsdp"``) writes at once, each its own slices of ``shards`` (the
    model's and optimizer's tensors), rank 0 also ``plain`` (the rest of the state; None
    elsewhere), over the process group ``group``. It returns on every process once the whole
    checkpoint is written, its location on rank 0; ``load`` then returns the whole state,
    every tensor whole, and ``load_sharded(location, shards, check)`` fills a sharded run's own
    ``shards`` in place, each process reading only its slices (after ``check(plain part)``;
    tensors under the ``optional`` key prefixes may be missing from it), and returns the whole
    state with them. Without it, a sharded run gathers its state to rank 0 to
    ``save`` it."""

    def save_sharded(self, update_step: int, shards: Mapping[str, Any], plain: Mapping[str, Any] | None,
                     group: Any) -> str: ...

    def load_sharded(self, location: str, shards: dict[str, Any],
                     check: Callable[[dict[str, Any]], None], optional: tuple[str, ...]) -> dict[str, Any]: ...
