"""The engine: one loop thread driving the scheduler (``llm_serving.core``) and the agent pool
(``llm_serving.executor``), a token stream per request, self-healing when a sequence, a step or an agent fails,
the admission check against the served configuration, the wiring from a ``ServingConfig`` to these parts, and
the offline API (``LLM``) on top of it. Knows nothing of HTTP.

May import: ``llm_serving.protocol``, ``core``, ``config``, ``tokenization``, ``models``, ``executor`` and
``request_errors``.
"""
