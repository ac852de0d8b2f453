"""Loggers (recipe tables ``[[logger]]``): ``console``, ``jsonl`` and
``wandb``. One module per logger holds its config, its code and its
registration."""
