"""Built-in checkpointers: ``local``."""

from octfw.hookspecs import hookimpl
from octfw.plugins.checkpointers.local import LocalCheckpointConfig


@hookimpl
def octfw_register_checkpointers(register):
    register(
        "local",
        LocalCheckpointConfig,
        "octfw.plugins.checkpointers.local:build",
        "Atomic torch.save to a local folder with a 'latest' pointer; keeps the newest keep_last.",
    )
