"""Questions about a recipe on a device, answered without a full run: the
pre-flight ``check`` and its ``memory`` estimate, ``bench`` (step time over a
grid of settings), ``replay`` of one saved update, which ``attention`` kernel
a device runs, and the XLA compile counters and graph dumps.

Above :mod:`octfw.engine` (they build and run its parts), below
:mod:`octfw.cli.commands` (which only parse arguments). Modules here may import
torch at module level: commands import them inside their ``run``.
"""
