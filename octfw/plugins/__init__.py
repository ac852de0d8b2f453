"""Built-in components. Each module registers the components of one stage
through the same hooks a third-party plugin uses; heavy imports happen inside
factories, never at module import."""

BUILTIN_PLUGINS: tuple[str, ...] = (
    "octfw.plugins.datasets",
    "octfw.plugins.transforms",
    "octfw.plugins.models",
    "octfw.plugins.schedulers",
    "octfw.plugins.guards",
    "octfw.plugins.loggers",
    "octfw.plugins.checkpointers",
    "octfw.plugins.evaluators",
)
