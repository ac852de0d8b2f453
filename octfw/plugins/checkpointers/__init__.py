"""Built-in checkpointers: ``local`` and ``gcs``."""

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.checkpointers.gcs import GcsCheckpointConfig
from octfw.plugins.checkpointers.local import LocalCheckpointConfig


@hookimpl
def octfw_register_checkpointers(register: Register) -> None:
    register(
        "local",
        LocalCheckpointConfig,
        "octfw.plugins.checkpointers.local:build",
        "Atomic torch.save to a local folder with a 'latest' pointer; keeps the newest keep_last.",
    )
    register(
        "gcs",
        GcsCheckpointConfig,
        "octfw.plugins.checkpointers.gcs:build",
        "Checkpoints to gs:// (any fsspec URL): object first, size-checked 'latest' pointer last; retries.",
    )
