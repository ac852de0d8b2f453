"""An example octfw plugin package."""
