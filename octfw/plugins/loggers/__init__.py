"""Built-in loggers: ``console``, ``jsonl`` and ``wandb``."""

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.loggers.console import ConsoleConfig
from octfw.plugins.loggers.jsonl import JsonlConfig
from octfw.plugins.loggers.wandb import WandbConfig


@hookimpl
def octfw_register_loggers(register: Register) -> None:
    register(
        "console",
        ConsoleConfig,
        "octfw.plugins.loggers.console:build",
        "Progress bar with live loss/lr/grad_norm on a terminal, plain lines elsewhere; end summary.",
    )
    register(
        "jsonl",
        JsonlConfig,
        "octfw.plugins.loggers.jsonl:build",
        "One JSON line per log step in <run_dir>/metrics.jsonl (non-finite values as null).",
    )
    register(
        "wandb",
        WandbConfig,
        "octfw.plugins.loggers.wandb:build",
        "Weights & Biases, rank 0 only: one run per job, its id kept in checkpoints to continue on resume.",
    )
