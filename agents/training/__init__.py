"""Training the small model pair the project ships (a target and a draft sharing one tokenizer), with MindSpore on
CPU, from text every Python installation has (``corpus``). ``python scripts/train_model_pair.py`` runs it.

May import: ``llm_serving.protocol``, ``agents.model`` and ``agents.weights`` (the script trains the tokenizer).
"""
