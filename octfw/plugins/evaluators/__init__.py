"""Built-in evaluators: measure the frozen encoder on labelled data."""
