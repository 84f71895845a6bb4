"""The performance model's one error type: unusable input, said in one line (exit 2)."""


class ModelError(ValueError):
    """Unusable input to the performance model; the message is one line."""
