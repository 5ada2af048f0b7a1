"""The launch configuration: the llm-serving YAML file read into sections (unknown keys named with a
suggestion, types checked) and validated into the frozen ``ServingConfig`` every other part is built from.

May import: ``llm_serving.protocol`` and ``llm_serving.core`` (the admission policies it validates).
"""
