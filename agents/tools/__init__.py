"""Command-line tools that use the agents' model without a master: MindIR export of every warm-up graph
(``python -m agents.tools.export``, behind ``llm-serving export``) and offline greedy generation with one
in-process runner (``python -m agents.tools.generate``, an independent reference for the engine).

May import: ``llm_serving.protocol``, ``agents.weights``, ``agents.model`` and ``agents.runtime``.
"""
