"""What several commands share: the recipe arguments and loading the registry once, from
:mod:`octfw.cli.arguments` (where plugins' commands find them too).
(The progress bar of long work is :func:`octfw.display.progress.progress_bar`.)"""

from __future__ import annotations

from octfw.cli.arguments import add_recipe_arguments, load_recipe_from_args, load_registry_once

__all__ = ["add_recipe_arguments", "load_registry_once", "load_recipe_from_args"]
