"""A run on disk: its folder, and the checkpoint it stands at.

- :mod:`octfw.runs.folder`: what a run writes at start and at the end, and the
  order of a recipe's runs (a recorded sequence, never a clock);
- :mod:`octfw.runs.checkpoint`: which checkpoint a run stands at, one answer
  for ``--resume auto``, export, eval, replay and ``octfw.load_encoder``.

This ``__init__`` imports nothing.
"""
