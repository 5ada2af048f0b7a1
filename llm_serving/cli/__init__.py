"""The ``llm-serving`` command line: ``main`` and one module per command in ``commands/``."""
