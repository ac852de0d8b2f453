"""Loggers (recipe tables ``[[logger]]``): ``console``, ``jsonl``, ``wandb``
and ``tensorboard``. One module per logger holds its config, its code and
its registration."""
