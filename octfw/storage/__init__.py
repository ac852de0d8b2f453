"""Where octfw's files live: local paths and fsspec URLs, atomic writes, checkpoint folders.

A low layer: it imports the standard library, fsspec and torch (inside
functions, so ``octfw list`` loads none of them, nor gcsfs), ``octfw.display.errors``
and ``octfw.recipe.fields``; never the engine, the recipe, the registry, the data
pipeline or a plugin.

- :mod:`octfw.storage.files`: a URL's filesystem (``open_filesystem``), the
  path of a local one (``is_local``, ``local_path``), and the one way octfw
  replaces a file so that no reader sees half of it (``write_atomically``);
- :mod:`octfw.storage.retry`: retries with exponential backoff for remote
  stores, and the ``StorageError`` raised when every attempt failed;
- :mod:`octfw.storage.reach`: whether a ``gs://`` location's endpoint answers,
  asked once with a short timeout (``require_reachable``), so an endpoint
  that is down is named in seconds instead of after gcsfs's minute of retries;
- :mod:`octfw.storage.checkpoints`: checkpoints in one folder, with the
  ``latest`` pointer, ``keep_last`` retention and SHA-256 checks written once
  for every checkpointer (``CheckpointStorage``), and reading any checkpoint
  by its URL (``load_checkpoint``);
- :mod:`octfw.storage.checkpointer`: the checkpointer over one folder
  (``StoredCheckpointer``);
- :mod:`octfw.storage.sharded_checkpoints`: a sharded run's checkpoint, a
  folder of every process's slices (``torch.distributed.checkpoint``), read
  without running code from it, whole or resharded in place;
- :mod:`octfw.storage.checkpoint_names`: the names of a checkpoint folder's
  files, which ``keep_last`` deletes, and the ``latest`` pointer's format;
- :mod:`octfw.storage.checkpoint_reading`: what a checkpoint may hold
  (``check_plain``), its SHA-256 check, and reading one file without running
  code from it (``safe_load``);
- :mod:`octfw.storage.owner`: one writer per folder (``FolderOwner``), for run
  folders, checkpoint folders and prepared stores;
- :mod:`octfw.storage.failures`: the cause of a failed write in words (no
  space, with bytes free and needed; permission denied; unreachable).
"""
