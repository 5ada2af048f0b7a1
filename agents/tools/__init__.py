"""Command-line tools that use the agents' model without a master: MindIR export of every warm-up graph
(``python -m agents.tools.export``, behind ``llm-serving export``), reading an exported graph node by node and
checking it against the fused Ascend ops' real contracts (``mindir``, ``contracts``), and offline greedy
generation with one in-process runner (``python -m agents.tools.generate``, an independent reference).

May import: ``llm_serving.protocol``, ``agents.weights``, ``agents.model`` and ``agents.runtime``.
"""
