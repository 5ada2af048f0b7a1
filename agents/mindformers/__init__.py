"""The ``model_config.backend: mindformers`` route: MindFormers' own Llama behind our runner interface.

``names`` (weight layouts, numpy only) is importable anywhere; ``runner`` and ``export`` need MindSpore 2.7.2
and MindFormers 1.8.0 (their own environment: ``scripts/mindformers_env.sh``).
"""
