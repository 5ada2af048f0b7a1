"""The error weight loading raises, in a module of its own so that the readers of each kind of weight
(``checkpoints``, ``moe_weights``) share it without importing each other."""

from __future__ import annotations


class WeightLoadError(ValueError):
    """Weights that are missing, malformed or do not match the model config."""
