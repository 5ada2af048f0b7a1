"""The ``llm-serving`` subcommands, one module each."""
