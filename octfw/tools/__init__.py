"""What the commands do beyond training: the pre-flight check, the memory
estimate, the benchmark grid, replay of one update step, export of an encoder,
evaluation of a trained encoder and the XLA counters.

This layer sits above :mod:`octfw.engine` (it builds and runs the engine's
parts) and below :mod:`octfw.commands` (which only parses arguments). Modules
here may import torch at module level: the CLI imports them inside the
command functions, never at start-up.
"""
