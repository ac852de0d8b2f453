"""Neural network implementations (imported only when a model is built)."""
