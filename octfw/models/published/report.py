"""What starting from published weights did to each tensor of the model (light: no torch)."""

from __future__ import annotations

import attrs

__all__ = ["InitReport"]


@attrs.define
class InitReport:
    """Keys of the model's state dict, each loaded, adapted or left new, for ``octfw check``.

    ``loaded``: copied from the checkpoint as they are. ``adapted``: key -> how it was
    changed to fit the recipe's network (RGB to one channel, a tubelet inflated, a position
    table resampled). ``new``: key -> why it keeps its fresh initialisation. ``ignored``:
    checkpoint key -> why nothing was made of it. ``notes``: what differs without a key
    (a LayerNorm epsilon).
    """

    source: str
    format: str
    loaded: list[str] = attrs.field(factory=list)
    adapted: dict[str, str] = attrs.field(factory=dict)
    new: dict[str, str] = attrs.field(factory=dict)
    ignored: dict[str, str] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)

    def took(self, key: str, how: str = "") -> None:
        """``key`` came from the checkpoint: loaded as it is, or adapted (``how``: what was changed)."""
        if how:
            self.adapted[key] = how
        else:
            self.loaded.append(key)

    def lines(self) -> list[str]:
        """The report as ``octfw check`` prints it: counts, then every adapted key by name,
        the new ones grouped by reason, the ignored checkpoint keys and the notes."""
        out = [f"init      {self.source} ({self.format}): {len(self.loaded)} tensors loaded, "
               f"{len(self.adapted)} adapted, {len(self.new)} left new, {len(self.ignored)} checkpoint keys ignored"]
        out += [f"  adapted {key}: {how}" for key, how in self.adapted.items()]
        for reason, keys in _grouped(self.new).items():
            out.append(f"  new     {_listed(keys)}: {reason}")
        for reason, keys in _grouped(self.ignored).items():
            out.append(f"  ignored {_listed(keys)}: {reason}")
        out += [f"  note    {note}" for note in self.notes]
        return out


def _grouped(reasons: dict[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for key, reason in reasons.items():
        groups.setdefault(reason, []).append(key)
    return groups


def _listed(keys: list[str], most: int = 4) -> str:
    shown = ", ".join(keys[:most])
    return shown if len(keys) <= most else f"{shown} and {len(keys) - most} more"
