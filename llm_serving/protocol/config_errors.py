"""The error a model's own configuration raises, in a module of its own so that the config readers of each part
(``model_config``, ``moe_config``) share it without importing each other."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A model directory or config.json that cannot be served."""
