"""Model directories the master makes itself: the embedded default model (built once, cached) and seeded
random-weight Llama checkpoints in Hugging Face format (for the default model, tests and benchmarks).

May import: ``llm_serving.protocol``, ``llm_serving.config`` and ``llm_serving.tokenization``.
"""
