"""The jobs the CLI and the API run end to end: evaluate a model, compare schemes or methods, estimate the time."""
