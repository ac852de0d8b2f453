"""Built-in schedulers: ``cosine-no-restart`` and ``constant``."""

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.schedulers.constant import ConstantConfig
from octfw.plugins.schedulers.cosine import CosineConfig


@hookimpl
def octfw_register_schedulers(register: Register) -> None:
    register(
        "cosine-no-restart",
        CosineConfig,
        "octfw.plugins.schedulers.cosine:build",
        "Linear warmup, one cosine decay to min_lr, then flat; cannot restart.",
    )
    register(
        "constant",
        ConstantConfig,
        "octfw.plugins.schedulers.constant:build",
        "Keeps the optimizer's base_lr (never rewrites it); EMA and weight decay optional.",
    )
