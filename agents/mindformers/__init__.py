"""The ``model_config.backend: mindformers`` route: MindFormers' own Llama behind our runner interface.

``runner`` and ``export`` need MindSpore 2.7.2 and MindFormers 1.8.0 (their own environment:
``scripts/mindformers_env.sh``); the weight names both ways live in ``agents.weights.mindformers_names`` (numpy
only, importable anywhere).

May import: ``llm_serving.protocol``, ``agents.weights``, ``agents.runtime`` and ``agents.tools``.
"""
